"""Run several Python scripts one after another in this one process, each as
``python script *args`` runs it (``__name__ == "__main__"``, its own ``sys.argv``, its folder
first on ``sys.path``), and print each one's exit code and output as a JSON list.

For tests/test_examples.py: starting Python and importing torch and tensordict takes about
2.5 s of CPU a process on a small machine, more than most of these scripts' own work.

    python tests/one_process.py '[["examples/quickstart.py", []], ...]'
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import tempfile
import traceback
from typing import Any


def run(path: str, args: list[str]) -> dict[str, Any]:
    argv, first = sys.argv, sys.path[0]
    sys.argv, sys.path[0] = [path, *args], os.path.dirname(os.path.abspath(path))
    code: Any = 0
    # The script's output, at the level of the file descriptors (a script may hand them to
    # C code: faulthandler, torch's warnings).
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        saved = os.dup(1), os.dup(2)
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(out.fileno(), 1), os.dup2(err.fileno(), 2)
        try:
            runpy.run_path(path, run_name="__main__")
        except SystemExit as exit_:
            code = exit_.code
            if isinstance(code, str):  # `raise SystemExit("message")`: python prints it
                print(code, file=sys.stderr)
                code = 1
        except BaseException:
            traceback.print_exc()
            code = 1
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])
        out.seek(0), err.seek(0)
        stdout, stderr = out.read(), err.read()
    sys.argv, sys.path[0] = argv, first
    return {"path": path, "returncode": code or 0, "stdout": stdout, "stderr": stderr}


if __name__ == "__main__":
    runs = [run(path, args) for path, args in json.loads(sys.argv[1])]
    sys.stdout.write(json.dumps(runs))
