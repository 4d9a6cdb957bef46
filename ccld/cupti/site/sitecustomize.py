"""ccld's CUPTI shim, put first on a traced job's PYTHONPATH by `ccld run` (not a package).

Python imports the first `sitecustomize` on its path at start-up, so this one would hide the
job's own (a virtualenv's, a site's, a user's PYTHONPATH entry): it runs that one first, exactly as
Python would have, then starts ccld's capture in rank processes (ccld/cupti/shim.py decides which).
Nothing here may break or slow the job: a failing chained sitecustomize is reported as Python
reports it; a failing shim prints one line and the job goes on. Keep this file small and free of
imports from ccld until the shim is known to be wanted.
"""
import os
import sys


def _chain() -> None:
    import importlib.machinery
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
    except Exception as e:  # what site.py prints for a failing sitecustomize; the job starts anyway
        sys.stderr.write(f"Error in sitecustomize; set PYTHONVERBOSE for traceback:\n{type(e).__name__}: {e}\n")


def _start() -> None:
    if not os.environ.get("CCLD_CUPTI_ENDPOINT") or "RANK" not in os.environ:
        return  # not under `ccld run`, or not a rank: import nothing
    try:
        try:
            from ccld.cupti import shim
        except ImportError:
            pkg = os.environ.get("CCLD_CUPTI_PKG")
            if not pkg:
                raise
            sys.path.append(pkg)  # last: never hides one of the job's own modules
            try:
                from ccld.cupti import shim
            finally:
                sys.path.remove(pkg)  # the shim's modules are loaded; leave the job's path as it was
        shim.maybe_start()
    except Exception as e:
        try:
            os.write(2, f"ccld: CUPTI capture is off in pid {os.getpid()}: {type(e).__name__}: {e}; "
                        "the job goes on without GPU timing\n".encode(errors="replace"))
        except OSError:
            pass


_chain()
_start()
