"""Launching a script on N CPU ranks (gloo), as torchrun would, for the distributed tests.

Each launch costs several seconds here (every rank imports torch), so the
default skips torchrun's own interpreter: the ranks are started directly
with the environment torchrun would give them.
"""

from __future__ import annotations

import functools
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 180
# A launch of several cases (launch_cases): the longest, six 200-step FSDP2 runs, takes about a minute.
CASES_TIMEOUT_S = 600


def launch_two_ranks(command: list[str], torchrun: bool = False) -> subprocess.CompletedProcess:
    return launch(command, nproc=2, torchrun=torchrun)


def launch(command: list[str], nproc: int = 2, torchrun: bool = False,
           timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    """Run ``python *command`` on ``nproc`` ranks; rank 0's stdout as is, the others' prefixed ``[rankR]: ``."""
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if torchrun:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
        return subprocess.run([*launcher, *command], capture_output=True, text=True, timeout=timeout_s, env=env)
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE=str(nproc),
               LOCAL_WORLD_SIZE=str(nproc))
    with tempfile.TemporaryDirectory() as logs:
        workers = []
        for rank in range(nproc):
            out, err = (open(Path(logs) / f"{rank}.{kind}", "w+") for kind in ("out", "err"))
            process = subprocess.Popen([sys.executable, *command], stdout=out, stderr=err, text=True,
                                       env=dict(env, RANK=str(rank), LOCAL_RANK=str(rank)))
            workers.append((process, out, err))
        deadline = time.monotonic() + timeout_s
        while any(process.poll() is None for process, _, _ in workers):
            failed = any(process.poll() not in (None, 0) for process, _, _ in workers)
            if failed or time.monotonic() > deadline:
                # A failed rank leaves the others waiting in a collective: stop them, as torchrun would.
                for process, _, _ in workers:
                    if process.poll() is None:
                        process.kill()
            time.sleep(0.05)
        returncode = next((p.returncode for p, _, _ in workers if p.returncode), 0)
        outputs = []
        for process, out, err in workers:
            process.wait()
            out.seek(0), err.seek(0)
            outputs.append((out.read(), err.read()))
            out.close(), err.close()
    stdout = "".join(prefix_lines(o, rank) if rank else o for rank, (o, _) in enumerate(outputs))
    stderr = "".join(prefix_lines(e, rank) for rank, (_, e) in enumerate(outputs))
    return subprocess.CompletedProcess(command, returncode, stdout, stderr)


def prefix_lines(text: str, rank: int) -> str:
    return "".join(f"[rank{rank}]: {line}\n" for line in text.splitlines())


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@functools.cache
def launch_cases(command: tuple[str, ...], nproc: int = 2) -> subprocess.CompletedProcess:
    """``launch`` of a script running several cases, once per session for every test that reads it.

    A case prints ``RESULT: VERDICT on N rank(s): LABEL...``; ``case_result`` finds one test's line.
    """
    return launch(list(command), nproc=nproc, timeout_s=CASES_TIMEOUT_S)


def case_result(result: subprocess.CompletedProcess, label: str, nproc: int = 2) -> tuple[str, str]:
    """The verdict and the message of the case whose message starts with ``label``."""
    found = re.search(rf"^RESULT: (\w+) on {nproc} rank\(s\): ({re.escape(label)}.*)$", result.stdout, re.M)
    assert found, f"no result for {label!r} (exit {result.returncode}):\n" + (result.stdout + result.stderr)[-4000:]
    return found.group(1), found.group(2)


# tests/_remainder_fsdp2_ranks.py's modes and the prefix of each case's label (its RESULT lines'
# message starts with PREFIX + "OPTIMIZER PRECISION:").
CASE_PREFIXES = {"direct": "", "amp": "amp O2 ", "whole": "whole "}


def fsdp2_case(script: Path, mode: str, optimizers: tuple[str, ...] | list[str], precisions: tuple[str, ...],
               steps: int, optimizer: str, precision: str, *options: str, expect: str = "bitwise") -> str:
    """One case's message from the launch of ``script`` running every optimizer and precision of ``mode``.

    The launch runs once per session for all the tests that ask for its cases (one start-up);
    the case's verdict must be ``expect``.
    """
    command = (str(script), mode, ",".join(optimizers), ",".join(precisions), str(steps), *options)
    verdict, message = case_result(launch_cases(command), f"{CASE_PREFIXES[mode]}{optimizer} {precision}:")
    assert verdict == expect, message
    return message
