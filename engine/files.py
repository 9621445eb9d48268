"""Files written whole or not at all, checked against the digests written with them, and JSON Lines read with a
crash in mind: the helpers every tool's files share."""
import contextlib
import gzip
import hashlib
import json
import os
import sys
import zipfile

HASH_CHUNK = 1 << 24  # bytes hashed at a time when a file is read to verify it (16 MiB: memory stays small)


class DamagedError(ValueError):
    """A file whose bytes differ from the checksum written with them (a changed byte, a truncated copy)."""


class HashingWriter:
    """A binary file object that counts, and hashes (sha256), every byte written through it, as it goes: entry() is
    the file's, without reading it back. sha256=False: counted only (a file that holds checksums of its own)."""

    def __init__(self, f, sha256=True):
        self.f, self.sha256, self.size = f, hashlib.sha256() if sha256 else None, 0

    def write(self, b):
        if self.sha256 is not None:
            self.sha256.update(b)  # hashlib releases the GIL on large buffers
        self.size += memoryview(b).nbytes
        return self.f.write(b)

    def entry(self):
        """{"bytes", "sha256"}: a manifest's entry of what was written ("bytes" alone, uncounted)."""
        return {"bytes": self.size, **({"sha256": self.sha256.hexdigest()} if self.sha256 is not None else {})}

    def __getattr__(self, name):  # tell, flush, fileno, close: the file's own
        return getattr(self.f, name)


def file_entry(path):
    """{"bytes", "sha256"} of a file, read in chunks (to verify it against a manifest's entry)."""
    sha256, size = hashlib.sha256(), 0
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            sha256.update(chunk)
            size += len(chunk)
    return {"bytes": size, "sha256": sha256.hexdigest()}


def check_entry(path, expected, what, hashes=True):
    """A DamagedError naming path and what differs if its size (and, hashes, its sha256 when the entry has one) is
    not expected's (a manifest's entry); what names the manifest."""
    if not os.path.exists(path):
        raise DamagedError(f"{path}: missing ({what} lists it)")
    size = os.path.getsize(path)
    if size != expected["bytes"]:
        raise DamagedError(f"{path}: {size} bytes, {what} says {expected['bytes']} (a truncated or changed copy)")
    if hashes and "sha256" in expected and file_entry(path)["sha256"] != expected["sha256"]:
        raise DamagedError(f"{path}: its sha256 differs from {what}'s {expected['sha256'][:16]}... (a damaged copy)")


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


def verify_zip(f, what):
    """Every entry of the zip file f read, which checks its CRC-32 (zipfile does at an entry's end): a DamagedError
    saying what (the file; a part of it) and which entry differs. A zip holds a CRC-32 of every entry: torch.save's
    format since torch 1.6."""
    entry = None
    try:
        with zipfile.ZipFile(f) as z:
            for entry in z.infolist():
                with z.open(entry) as data:
                    while data.read(HASH_CHUNK):
                        pass
    except zipfile.BadZipFile as e:
        detail = (f"entry {entry.filename}: its bytes do not match the CRC-32 {entry.CRC:08x} written with them"
                  if entry is not None and str(e).startswith("Bad CRC-32") else
                  f"entry {entry.filename}: {e}" if entry is not None else
                  f"{e} (its zip directory, at the end, is missing: a truncated copy?)")
        raise DamagedError(f"{what}: damaged: {detail}") from None
    except (OSError, EOFError, ValueError, NotImplementedError) as e:  # zipfile's others, on bytes it cannot parse
        raise DamagedError(f"{what}: damaged: {e or type(e).__name__}") from None


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
