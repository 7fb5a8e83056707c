import os
import sys

import pytest

# Shared test helpers (prompts.py, e2e/server.py) import by plain module name.
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

# A user's clone stands alone: nothing the tests run may read the development checkout's sibling
# folder `shared` (prompt sets and notes that users do not have). An audit hook records every
# file this process opens or lists there, and the session fails if there was any.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_SIBLING = os.path.join(os.path.dirname(_REPO), "shared")
_outside: list = []


def _audit(event, args):
    if event in ("open", "os.listdir", "os.scandir") and args:
        path = args[0]
        if isinstance(path, (str, bytes, os.PathLike)):
            path = os.path.abspath(os.fsdecode(path))
            if path == _SIBLING or path.startswith(_SIBLING + os.sep):
                _outside.append(path)


sys.addaudithook(_audit)


def pytest_sessionfinish(session, exitstatus):
    if _outside:
        print(f"\nERROR: tests read outside the repository: {sorted(set(_outside))[:10]}", file=sys.stderr)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
