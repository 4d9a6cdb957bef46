"""GPU timing from CUPTI, captured inside the job's ranks and shipped to the node agent.

  names.py      NCCL kernel names -> op / reduction / dtype / algorithm / protocol
  capture.py    which CUPTI activity kinds are on; the buffer callbacks (bounded, counted)
  correlate.py  kernel <-> launch API record (thread, time) by correlation id
  clock.py      CUPTI ns -> CLOCK_MONOTONIC ns, the one conversion
  shim.py       the in-process runtime: sender thread, ZeroMQ PUSH, failure and exit handling
  inject.py     `ccld run`'s side: probe once, put site/sitecustomize.py on the job's PYTHONPATH
  site/         the sitecustomize that starts the shim (not a package)

The CUPTI module is always passed in (dependency injection), so a fake with the same record shapes
drives the tests on machines without a GPU. What was verified against cupti-python, and how, is in
docs/cupti.md.
"""
