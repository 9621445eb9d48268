"""Files written whole or not at all, and JSON Lines read with a crash in mind: the helpers every tool's files share."""
import contextlib
import gzip
import json
import os
import sys


@contextlib.contextmanager
def atomic_write(path, mode="wb"):
    """Write through a temp file that is fsynced and renamed into place when the block succeeds:
    readers never see half a file, and a crash or error leaves the previous file, if any, intact."""
    path = str(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, mode, encoding=None if "b" in mode else "utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(os.path.dirname(os.path.abspath(path)))  # make the rename itself durable
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_jsonl(path, check=None):
    """The JSON values of a JSON Lines file (gzipped if it ends in .gz), one per non-blank line, as they are read.
    A last line that is not JSON and has no newline was cut by a crash mid-write (train.py's log.jsonl, say): it
    is skipped with a note. Any other bad line is an error naming it, as is check(value) when it returns what
    is wrong with a value (None when it is right)."""
    with (gzip.open if str(path).endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                value = json.loads(line)
            except ValueError as e:
                if not line.endswith("\n"):
                    print(f"note: {path}:{n}: the last line is cut short (a crash mid-write?), skipped",
                          file=sys.stderr)
                    return
                raise ValueError(f"{path}:{n}: not valid JSON ({e})") from None
            problem = check(value) if check else None
            if problem:
                raise ValueError(f"{path}:{n}: {problem}")
            yield value


def fsync_dir(path):
    """Make the renames in a directory durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
