"""Write the bytecode of every module a server and the tests import, once, at setup.

Why: the CI machine kind sets PYTHONDONTWRITEBYTECODE=1 and uv installs without .pyc files, so
every Python process (each server, scheduler, rank, zygote, CLI subprocess and pytest worker)
compiled torch + SGLang + transformers from source: importing SGLang's HTTP server took 43 s
with no .pyc files and 18.6 s with them (measured on the 2-core machine). Python still reads
.pyc files when it may not write them, so compiling them here helps every later process.

Importing is the cheapest way to find the ~7,000 modules actually used out of the venv's ~35,000
(compiling all of them took 86 s); the packages below that import modules lazily at run time
(request handlers, hypothesis' shrinker, uvicorn's protocols) are compiled whole.
Run by scripts/setup_env.sh with bytecode writing on; safe to rerun (up-to-date files are kept).
"""

import compileall
import importlib
import os
import pkgutil
import sys
import sysconfig
import time
import warnings

SERVER = (
    "sglang.launch_server",
    "sglang.srt.entrypoints.http_server",
    "sglang.srt.managers.scheduler",
    "sglang.srt.managers.detokenizer_manager",
    "sglang.srt.model_executor.model_runner",
)
TESTS = ("transformers", "hypothesis", "openai", "scipy.optimize", "scipy.stats", "xdist", "requests")
# Imported lazily while serving or testing, so no import above reaches them.
WHOLE = (
    "hypothesis",
    "anyio",
    "uvicorn",
    "_pytest",
    "xdist",
    "execnet",
    "smg_grpc_servicer",
    "sglang/srt/entrypoints",
    "sglang/srt/distributed",
    "sglang/srt/speculative",
    "sglang/srt/dllm",
    "sglang/kernels/ops",
)


def main() -> int:
    sys.dont_write_bytecode = False
    warnings.filterwarnings("ignore")
    start = time.time()
    import sglang_dsv4_ascend

    ours = [m.name for m in pkgutil.walk_packages(sglang_dsv4_ascend.__path__, "sglang_dsv4_ascend.")]
    failed = []
    for name in (*SERVER, *TESTS, *ours):
        try:
            importlib.import_module(name)
        except Exception as e:  # a module that needs hardware we lack is not a setup failure
            failed.append(f"{name} ({type(e).__name__})")
    site = sysconfig.get_paths()["purelib"]
    for rel in WHOLE:
        path = os.path.join(site, rel)
        if os.path.isdir(path):
            compileall.compile_dir(path, quiet=2, workers=0)
    print(f"[setup] bytecode written for the modules servers and tests import ({time.time() - start:.0f} s)")
    if failed:
        print(f"[setup] not importable here (skipped): {', '.join(failed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
