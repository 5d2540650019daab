"""The process's file-handle limit: raised to the hard limit at start, and the bound on the
connections a server holds that it leaves.

Every connection a server holds is one file handle, and the soft limit is often 1,024: past it
`accept()` fails with EMFILE and nothing new is served, `/health` included. So `spillway serve`
(and `spillway worker`) raise the soft limit to the hard one first, as vLLM does; the worker a
server starts inherits it. Where the hard limit itself is low, raising does not help: a server
then holds at most `connection_limit()` connections and makes room for a new one by closing the
one waiting longest for its request (gateway/http/connection_bound.py).
"""

from __future__ import annotations

import logging
import os
import resource

logger = logging.getLogger("spillway.gateway")

# Below this many handles a server holds fewer connections than a busy deployment opens (vLLM
# raises its soft limit to 65,535 for the same reason): said once at start.
ENOUGH_OPEN_FILES = 65536
# Handles kept free beside the connections, for what a server opens while it serves: a
# replacement worker's link and pipes, the metrics files a scrape reads (one per process and
# kind), the tokenizer's files, log files. Each of those holds a handful at a time.
RESERVED_FILE_HANDLES = 64


def raise_open_file_limit() -> int:
    """Raise the soft RLIMIT_NOFILE to the hard limit (to the kernel's `nr_open` where the hard
    limit is unlimited); a warning if the limit stays below ENOUGH_OPEN_FILES. The soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else _kernel_max_open()
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError) as exc:
            logger.warning("could not raise the open-file limit from %d to %d: %s", soft, target, exc)
    if soft != resource.RLIM_INFINITY and soft < ENOUGH_OPEN_FILES:
        logger.warning("the open-file limit is %d (hard limit %s): a server holds at most about %d connections "
                       "at once and closes the one waiting longest for its request to take another; raise the "
                       "hard limit (ulimit -Hn, LimitNOFILE=) for more", soft,
                       "unlimited" if hard == resource.RLIM_INFINITY else hard,
                       max(1, soft - RESERVED_FILE_HANDLES - len(_open_handles())))
    return soft


def connection_limit() -> int:
    """The most connections this process should hold: its soft limit less the handles open now
    (the worker link, the listening socket, logs, ...) and RESERVED_FILE_HANDLES; at least 1."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        soft = _kernel_max_open()
    return max(1, soft - len(_open_handles()) - RESERVED_FILE_HANDLES)


def _open_handles() -> list[str]:
    for folder in ("/proc/self/fd", "/dev/fd"):
        try:
            return os.listdir(folder)
        except OSError:
            continue
    return []


def _kernel_max_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20
