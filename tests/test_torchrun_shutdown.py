"""A finished torchrun rank exits cleanly: what it started is stopped, in order, before the interpreter finalizes.

The abort this guards against (issue 24: ``terminate called without an active exception``, exit -6 after the
work was done, 3 launches in 17 on a busy machine) came from the watchdog thread: a daemon, it was left to the
interpreter's finalization, and when a store call it was in (C++, the GIL released) returned then, taking the
GIL back killed the thread by an unwinding C++ cannot let through.  The window is a store round trip per tick:
rare.  Here it is made wide -- a timeout so small the watchdog calls the store without pause -- and the rank
(one, rendezvous on this host, no torchrun needed) must still exit 0, having joined the watchdog and destroyed
the process group before the last ``atexit`` hook runs.
"""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

RANK = textwrap.dedent("""
    import atexit, os, threading
    os.environ.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="0")  # 0: any free port
    import torch.distributed as dist

    def last():  # registered first, so it runs after every hook registered later: what is left at the end
        alive = [t.name for t in threading.enumerate() if t.name.startswith("minizero-watchdog")]
        print(f"at exit: watchdog threads alive {alive}, process group {dist.is_initialized()}", flush=True)

    atexit.register(last)
    from minizero.run.torchrun import init_from_env
    init_from_env(backend="gloo", timeout_s=1e-6)  # the watchdog ticks every 2.5e-7 s: always in a store call
    print("work done", flush=True)
""")


def test_a_finished_rank_joins_its_watchdog_and_destroys_its_process_group_before_exit(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parent.parent)})
    text = out.stdout + out.stderr
    assert "work done" in out.stdout, text
    assert "at exit: watchdog threads alive [], process group False" in out.stdout, text
    assert "terminate called" not in text and out.returncode == 0, text
