"""Files written whole or not at all, checked against the digests written with them (by the ranks of a launch
together), and JSON Lines read with a crash in mind: the helpers every tool's files share."""
import bisect
import contextlib
import gzip
import hashlib
import io
import json
import os
import struct
import sys
import zipfile
import zlib

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


def check_entry(path, expected, what, hashes=True, data=None):
    """A DamagedError naming path and what differs if its size (and, hashes, its sha256 when the entry has one) is
    not expected's (a manifest's entry); what names the manifest. data: the file's bytes, read already (checked
    instead of reading it again)."""
    if data is None and not os.path.exists(path):
        raise DamagedError(f"{path}: missing ({what} lists it)")
    size = os.path.getsize(path) if data is None else len(data)
    if size != expected["bytes"]:
        raise DamagedError(f"{path}: {size} bytes, {what} says {expected['bytes']} (a truncated or changed copy)")
    if hashes and "sha256" in expected and expected["sha256"] != (
            file_entry(path)["sha256"] if data is None else hashlib.sha256(data).hexdigest()):
        raise DamagedError(f"{path}: its sha256 differs from {what}'s {expected['sha256'][:16]}... (a damaged copy)")


# ----------------------------------------------------------------------------- checked by the ranks of a launch
# The ranks of a launch read the same files (a checkpoint, the shards) on shared storage, and must act as one: resume
# from the same checkpoint, skip the same ones, refuse with the same line. Each helper takes worker, a
# parallel.Worker (None: one process, which does it all alone).

def note(message, worker=None):
    """A line on stderr, said once: by rank 0 alone of worker's ranks, which all see the same (in one write, as
    parallel.tell: the ranks share torchrun's stderr)."""
    if worker is None or worker.master:
        sys.stderr.write(message + "\n")
        sys.stderr.flush()


def share(sizes, worker=None):
    """The indices of the items (of these sizes in bytes, in order) whose check falls to this rank: a run of them of
    about 1/world_size of the bytes (an item goes to the rank in whose share its middle byte lies), so that every
    byte is checked once per launch, each rank reading one stretch; all of them in one process (or one that stands
    for a rank of a launch alone: the dry run's)."""
    if worker is None or not worker.distributed or worker.world_size == 1:
        return list(range(len(sizes)))
    total, start, mine = max(sum(sizes), 1), 0, []
    for i, n in enumerate(sizes):
        if min((2 * start + n) * worker.world_size // (2 * total), worker.world_size - 1) == worker.rank:
            mine.append(i)
        start += n
    return mine


def agreed(read, worker=None):
    """read()'s value, or, when it raised a ValueError (a DamagedError among them) or an OSError on any rank, the
    first such error (by rank) raised on every rank alike: a byte damaged on one rank's read alone, or a read that
    failed there, stops or skips it on all of them. A collective: every rank calls it."""
    try:
        value, error = read(), None
    except (ValueError, OSError) as e:
        value, error = None, e
    if worker is not None:
        error = worker.agree(error)
    if error is not None:
        raise error
    return value


def decided(make, worker=None):
    """make()'s value, made once for the launch, by rank 0, and the same on every rank (a collective; an error of
    rank 0's raised on all): which files are there to read, as one rank sees them (another host's file system cache
    may see a directory as it was a moment before)."""
    if worker is None or not worker.distributed:
        return make()
    made = None
    if worker.master:
        try:
            made = (make(), None)
        except (ValueError, OSError) as e:
            made = (None, e)
    value, error = worker.from_master(made)
    if error is not None:
        raise error
    return value


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
    VerifyingReader(f, what).check()


class WholeReads(io.FileIO):
    """A file opened for reading without a buffer, so that each read reads what was asked and no more (torch.load and
    zipfile seek from entry to entry, where a buffer reads ahead 4-8 kB at each), and each readinto fills its buffer
    up to the file's end (the OS's read returns at most 2 GiB, and torch.load takes a shorter read for a failure)."""

    def readinto(self, buffer):
        view, n = memoryview(buffer).cast("B"), 0
        while n < len(view) and (got := super().readinto(view[n:])):
            n += got
        return n


class VerifyingReader(io.RawIOBase):
    """The zip file f (open for reading, binary: WholeReads, so that a read reads no more than asked) as a file that
    computes each stored entry's CRC-32 from the bytes read through it, as they are read: torch.load reads each entry
    once, in order, so that check() after it verifies the file without reading it again (a read with mmap is not
    seen here: verify it first). check() reads, with zipfile, what was not read whole in order (a compressed entry;
    one torch.load left out). A zip whose directory cannot be read is a DamagedError here; what names the file (and a
    part of it) in errors."""

    def __init__(self, f, what):
        self.f, self.what, self.pos = f, what, 0
        with self._damage(None):
            self.zip = zipfile.ZipFile(f)  # its directory, at the end: a truncated copy has none
            starts = {id(info): _data_start(f, info) for info in self.zip.infolist()
                      if info.compress_type == zipfile.ZIP_STORED}
        # [info, where its data starts, bytes CRC'd so far, their CRC-32]; one whose local header is not as
        # written is left to check(), which says what is wrong with it
        self.entries = sorted(([info, starts[id(info)], 0, 0] for info in self.zip.infolist()
                               if starts.get(id(info)) is not None), key=lambda e: e[1])
        self.starts = [e[1] for e in self.entries]

    def readable(self):
        return True

    def seekable(self):
        return True

    def seek(self, pos, whence=0):
        self.pos = self.f.seek(self.pos + pos, 0) if whence == 1 else self.f.seek(pos, whence)  # f's own may differ
        return self.pos

    def tell(self):
        return self.pos

    def readinto(self, buffer):
        self.f.seek(self.pos)
        n = self.f.readinto(buffer)
        data, end = memoryview(buffer).cast("B")[:n], self.pos + n
        for entry in self.entries[max(0, bisect.bisect_right(self.starts, self.pos) - 1):]:
            info, start, done, crc = entry
            if start >= end:
                break
            if start + done == max(self.pos, start) < start + info.file_size:  # the next bytes of the entry
                upto = min(end, start + info.file_size)
                entry[3] = zlib.crc32(data[start + done - self.pos:upto - self.pos], crc)
                entry[2] = upto - start
        self.pos = end
        return n

    def check(self):
        """Every entry against its CRC-32, in the zip's order: a DamagedError naming the first that differs."""
        read = {id(info): (done == info.file_size, crc) for info, _, done, crc in self.entries}
        for info in self.zip.infolist():
            with self._damage(info):
                whole, crc = read.get(id(info), (False, None))
                if not whole:
                    with self.zip.open(info) as data:
                        while data.read(HASH_CHUNK):
                            pass
                elif crc != info.CRC:
                    raise zipfile.BadZipFile(f"Bad CRC-32 for file {info.filename!r}")  # zipfile's words

    @contextlib.contextmanager
    def _damage(self, entry):
        """zipfile's errors inside, on entry (None: the directory), as a one-line DamagedError."""
        try:
            yield
        except zipfile.BadZipFile as e:
            if isinstance(e.__context__, OSError):  # a read that failed, which zipfile words as a damaged zip
                raise DamagedError(f"{self.what}: damaged: {e.__context__}") from None
            detail = (f"entry {entry.filename}: its bytes do not match the CRC-32 {entry.CRC:08x} written with them"
                      if entry is not None and str(e).startswith("Bad CRC-32") else
                      f"entry {entry.filename}: {e}" if entry is not None else
                      f"{e} (its zip directory, at the end, is missing: a truncated copy?)")
            raise DamagedError(f"{self.what}: damaged: {detail}") from None
        except (OSError, EOFError, ValueError, NotImplementedError) as e:  # zipfile's others, on bytes it cannot parse
            raise DamagedError(f"{self.what}: damaged: {e or type(e).__name__}") from None


LOCAL_HEADER = 30  # bytes of a zip entry's local header, before its name and extra field (APPNOTE 4.3.7)


def _data_start(f, info):
    """Where the data of a zip entry begins in f, after its local header; None if that header is not the entry's."""
    f.seek(info.header_offset)
    header = f.read(LOCAL_HEADER)
    if len(header) != LOCAL_HEADER or header[:4] != b"PK\x03\x04":
        return None
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    if f.read(name_length) != info.orig_filename.encode("utf-8" if info.flag_bits & 0x800 else "cp437", "replace"):
        return None
    return info.header_offset + LOCAL_HEADER + name_length + extra_length


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
