"""XLA:CPU's per-call temporaries kept in glibc's heap (functrain/run/host_memory.py): after the call, a block of
their size comes from the heap (below the program break) instead of a fresh mapping, in a process of its own (the
allocator's settings are per process)."""

import subprocess
import sys
from pathlib import Path

MODULE = Path(__file__).resolve().parents[2] / "functrain" / "run" / "host_memory.py"
PROBE = """
import ctypes, ctypes.util, importlib.util, sys
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = libc.sbrk.restype = ctypes.c_void_p
libc.malloc.argtypes, libc.sbrk.argtypes = [ctypes.c_size_t], [ctypes.c_ssize_t]
if sys.argv[1] == "kept":
    spec = importlib.util.spec_from_file_location("host_memory", sys.argv[2])
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.keep_temporaries_in_heap()
block = libc.malloc(20 * 2**20)  # a train step's temporaries (bench_grpo: 20 MiB)
print("heap" if block < libc.sbrk(0) else "mapped")
"""


def test_a_block_of_temporaries_comes_from_the_heap_once_the_thresholds_are_set():
    where = {
        case: subprocess.run([sys.executable, "-c", PROBE, case, str(MODULE)], capture_output=True, text=True,
                             check=True).stdout.strip()
        for case in ("default", "kept")
    }  # fmt: skip
    assert where == {"default": "mapped", "kept": "heap"}
