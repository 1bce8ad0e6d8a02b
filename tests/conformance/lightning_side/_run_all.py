"""Runs every group script of this folder (each writes ../fixtures/<group>.json), importing torch
and Lightning once instead of once per group (`make conformance-fixtures`).

This process imports them, then forks a child per script, one after another: each group starts
from the state of a fresh interpreter that has just imported torch and Lightning (nothing one
group does — warnings shown once, tqdm's open bars, seeds — reaches the next, as when each ran
as its own process), without paying the ~4 CPU-seconds of those imports again. Nothing has
run a torch operation before the fork, so no thread pool is inherited.

    python _run_all.py              # every group, sorted
    python _run_all.py hooks.py     # some of them
"""

import os
import pathlib
import runpy
import sys

HERE = pathlib.Path(__file__).resolve().parent


def main(names: list[str]) -> int:
    import lightning.pytorch  # noqa: F401  (the imports every child shares)
    import torch  # noqa: F401

    scripts = [HERE / n for n in names] or sorted(HERE.glob("[!_]*.py"))
    for script in scripts:
        sys.stdout.flush()
        pid = os.fork()
        if pid == 0:  # the child: the group script as its own __main__
            status = 0
            try:
                runpy.run_path(str(script), run_name="__main__")
            except BaseException as err:  # noqa: BLE001 - reported, then the exit status says it
                import traceback

                traceback.print_exc()
                status = err.code if isinstance(err, SystemExit) and err.code else 1
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(status)
        _, raw = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(raw)
        if code:
            print(f"{script.name} failed (exit status {code})", file=sys.stderr)
            return code
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(HERE))
    sys.exit(main(sys.argv[1:]))
