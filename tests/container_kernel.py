"""Run INSIDE a test container (tests/containerhelpers.py): a real IPython kernel, started and
driven by ``jupyter_client`` in the same container, executes the cells given as a JSON list in
``argv[1]``; one JSON line per cell on stdout (``status``, ``stdout``, ``stderr``, ``texts``,
``error``). The kernel then lives, holding whatever it leased, until stdin is closed.
"""

from __future__ import annotations

import json
import os
import sys

from tests.kernelhelpers import Kernel


def main() -> int:
    cells = json.loads(sys.argv[1])
    kernel = Kernel(os.environ, cwd="/tmp")
    try:
        for code in cells:
            r = kernel.run(code, timeout=120)
            print(json.dumps({"code": code, "status": r.status, "stdout": r.stdout,
                              "stderr": r.stderr, "texts": r.texts(), "error": r.error}),
                  flush=True)
        sys.stdin.read()
    finally:
        kernel.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
