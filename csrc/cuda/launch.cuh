// The one way the CUDA launchers start a kernel:
//
//   APEX_AMP_LAUNCH(grid, block, shared_bytes, stream, kernel)(arguments...);
//
// is `kernel<<<grid, block, shared_bytes, stream>>>(arguments...)` in this
// build. The test-only host build of csrc/cuda (tests/emulation) defines the
// macro before this header is read, and runs the kernel's blocks and threads
// on the CPU instead. The kernel comes last so that the commas of a template
// kernel's arguments need no parentheses.
#pragma once

#ifndef APEX_AMP_LAUNCH
#define APEX_AMP_LAUNCH(grid, block, shared_bytes, stream, ...) \
  __VA_ARGS__<<<grid, block, shared_bytes, stream>>>
#endif
