// What the kernels_*.cpp files include before they choose an instruction set:
// every header of ATen and of the standard library that kernels.inc needs,
// except amp_math.h and the vector headers. Compiled here with the ordinary
// flags, none of their inline functions is ever built for AVX2 or AVX-512,
// so the linker cannot hand an AVX-512 copy of one to code that runs on a
// CPU without it.
#pragma once

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Float8_e4m3fn.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <optional>
#include <tuple>
#include <type_traits>

#include "cpu/kernel_table.h"
