"""A rank function in a module that reads an environment variable when it is imported: the child imports it
while it unpickles the function, which must come after the parent's environment is set
(tests/distributed/test_procs.py)."""

import os

VALUE = os.environ.get("LABKIT_TEST_AT_IMPORT")


def environment_seen(rank, world_size, names):
    """What a rank sees: the named variables, the start method it came from, the warning options its interpreter
    started with, and what this module read when the child imported it."""
    import multiprocessing
    import sys

    return {"env": {n: os.environ.get(n) for n in names}, "method": multiprocessing.get_start_method(),
            "warnoptions": list(sys.warnoptions), "at_import": VALUE, "pid": os.getpid()}
