"""What the benchmark drivers share: a port for one DeepSpeed run, and the
cleanup after it.  (Imported as ``_launch``: the scripts run from this folder.)"""

import contextlib
import glob
import os
import socket


@contextlib.contextmanager
def master_port():
    """A free TCP port for one DeepSpeed run.  On leaving, the /dev/shm
    all-reduce buffers of that run are deleted: DeepSpeed's CPU comm op leaves
    one per rank (66 MiB on 0.19, named after the port) and never unlinks it
    (deepspeedai/DeepSpeed#4115)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    try:
        yield port
    finally:
        for path in glob.glob(f"/dev/shm/deepspeed_*_{port}_*"):
            try:
                os.unlink(path)
            except OSError:
                pass
