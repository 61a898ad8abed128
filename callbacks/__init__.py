"""bnlit's pluggable Lightning callbacks, one file each, configured in ``conf/callbacks/``.

Each callback is a thin adapter: the maths lives in a pure function that is tested without a
Trainer; the callback decides when to call it, what to log and when to stop the run."""
