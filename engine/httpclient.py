"""
The one HTTP client: the resumable downloader (prepare.py's shards, convert.py's checkpoints) and get_json
(eval.py's data sets, convert.py's Hub listings), with one retry policy for both. Files are written through a
.part file and renamed into place only when complete and checked, against the sha256 the server announced for it
too (the Hugging Face Hub's X-Linked-Etag: an LFS file's object id); a host that cannot be reached at all fails at
once, saying what to do offline.
"""
import os
import re
import sys
import threading
import time

import requests
from tqdm import tqdm
from urllib3.exceptions import NewConnectionError

from engine.files import file_entry

# Our choices, for the Hub's rate limits and a flaky link:
MAX_TRIES = 8       # failed attempts in a row before giving up (for a file, an attempt that brings
                    # new bytes resets the count, so a flaky link still gets there)
BACKOFF = 1.0       # seconds before the first retry, doubled after each failure, at most 60 (tests set 0)
TIMEOUT = (10, 60)  # seconds: connect, and silence while reading


class DownloadError(RuntimeError):
    """A request that cannot succeed, or gave up. status: the HTTP status when the server refused it."""

    def __init__(self, message, status=None):
        super().__init__(message)
        self.status = status


class _Retry(Exception):
    """A failure worth another attempt (5xx, 429, dropped connection, short body). restart=True: the
    partial file is useless (the server will not resume it, or it is complete but invalid)."""

    def __init__(self, message, restart=False):
        super().__init__(message)
        self.restart = restart


class ByteBar:
    """One tqdm bar of bytes shared by the download threads (totals are learnt as files start)."""

    def __init__(self, **kw):
        self.bar = tqdm(total=0, unit="B", unit_scale=True, unit_divisor=1024, **kw)
        self.lock = threading.Lock()

    def grow(self, total):
        with self.lock:
            self.bar.total += total
            self.bar.refresh()

    def update(self, n):
        with self.lock:
            self.bar.update(n)

    def close(self):
        self.bar.close()


def cannot_connect(e):
    """The reason when no connection could be made at all (the name does not resolve, the port refuses):
    offline, retrying only waits. None for what can recover: timeouts, connections cut mid-answer."""
    reason = getattr(e.args[0], "reason", None) if e.args and not isinstance(e, requests.Timeout) else None
    if isinstance(reason, NewConnectionError):  # NameResolutionError is one too
        return f"{type(reason).__name__}: {str(reason).split('>: ', 1)[-1]}"  # drop urllib3's object repr
    return None


def _retryable(e, url, offline):
    """e if it can recover (retry it); a DownloadError at once for an unreachable host or a malformed URL."""
    if isinstance(e, (requests.exceptions.InvalidURL, requests.exceptions.MissingSchema,
                      requests.exceptions.InvalidSchema)):
        raise DownloadError(f"{url}: invalid URL ({e})") from None
    reason = None if isinstance(e, _Retry) else cannot_connect(e)
    if reason:
        raise DownloadError(f"{url}: cannot connect ({reason}); without internet, {offline}") from None
    return e


def _wait(url, failures, error):
    """After `failures` failed attempts in a row: give up at MAX_TRIES, else wait with exponential backoff."""
    if failures >= MAX_TRIES:
        raise DownloadError(f"{url}: giving up after {failures} failed attempts in a row (last: {error})")
    delay = min(BACKOFF * 2 ** (failures - 1), 60)
    tqdm.write(f"{url}: {error}; retrying in {delay:g}s", file=sys.stderr)
    time.sleep(delay)


def _refused(r):
    """The one line for an answer that retrying cannot change (4xx but 429)."""
    return DownloadError(f"{r.url}: HTTP {r.status_code} {' '.join(r.text.split())[:200]}", r.status_code)


def get_json(url, params=None, offline="copy the data from a machine with internet"):
    """GET url?params as JSON, retried like a download (429, 5xx, timeouts, cut connections); a 4xx, an
    unreachable host or an answer that is not JSON fails at once. offline: what to do without internet."""
    failures = 0
    while True:
        try:
            r = requests.get(url, params=params, timeout=TIMEOUT)
            if r.status_code == 429 or r.status_code >= 500:
                raise _Retry(f"HTTP {r.status_code} {' '.join(r.text.split())[:200]}")
            if r.status_code != 200:
                raise _refused(r)
            try:
                return r.json()
            except ValueError:
                raise DownloadError(f"{r.url}: the response is not JSON") from None
        except (_Retry, requests.RequestException) as e:
            error = _retryable(e, url, offline)
        failures += 1
        _wait(url, failures, error)


def announced_sha256(response):
    """The sha256 a server announced for a file, or None: the Hub's X-Linked-Etag (an LFS file's object id, on its
    redirect to the storage or on the answer itself); an etag of another form (a git blob's sha1) is none."""
    for r in [*response.history, response]:
        etag = r.headers.get("X-Linked-Etag", "").removeprefix("W/").strip('"').lower()
        if re.fullmatch(r"[0-9a-f]{64}", etag):
            return etag
    return None


def _attempt(url, part, have, bar, counted, stop, announced):
    """One HTTP request: append to `part` from byte `have`, or rewrite it when the server ignores
    the Range header. Returns the file size the server announced (None if it did not say); the sha256 it
    announced goes into announced[0]."""
    headers = {"Accept-Encoding": "identity"}  # byte ranges must refer to the file itself
    if have:
        headers["Range"] = f"bytes={have}-"
    with requests.get(url, headers=headers, stream=True, timeout=TIMEOUT) as r:
        if r.status_code == 404:
            raise FileNotFoundError(f"{url}: HTTP 404 Not Found (no such file; check --base_url)")
        if r.status_code == 416:  # our partial file is not shorter than theirs
            raise _Retry("HTTP 416: the server rejected the resume range", restart=True)
        if r.status_code >= 500 or r.status_code == 429:
            raise _Retry(f"HTTP {r.status_code} {r.reason}")
        if r.status_code == 206:
            crange = r.headers.get("Content-Range", "")  # "bytes START-END/TOTAL"
            try:
                start, total = int(crange.split()[1].split("-")[0]), crange.split("/")[1]
            except (IndexError, ValueError):
                raise _Retry(f"unreadable Content-Range {crange!r}", restart=True) from None
            if start != have:
                raise _Retry(f"the server resumed at byte {start}, not {have}", restart=True)
            total, mode = (int(total) if total.isdigit() else None), "ab"
        elif r.status_code == 200:  # no range support (or a fresh start): rewrite from byte 0
            length = r.headers.get("Content-Length", "")
            total, mode = (int(length) if length.isdigit() else None), "wb"
            bar.update(-have)
        else:
            raise _refused(r)
        announced[0] = announced_sha256(r) or announced[0]
        if total is not None and not counted[0]:
            bar.grow(total)
            counted[0] = True
        with open(part, mode) as f:
            for chunk in r.iter_content(chunk_size=1 << 20):
                if stop is not None and stop.is_set():
                    raise DownloadError(f"{url}: stopped")
                f.write(chunk)
                bar.update(len(chunk))
    return total


def _finish(part, dest, announced):
    """part, complete and checked, renamed to dest if its sha256 is the one announced (or none was): dest's manifest
    entry. Read once more, at disk speed: the download is what takes time."""
    entry = file_entry(part)
    if announced not in (None, entry["sha256"]):
        raise _Retry(f"downloaded file is damaged: its sha256 {entry['sha256'][:16]}... differs from the "
                     f"{announced[:16]}... the server announced", restart=True)
    os.replace(part, dest)
    return {**entry, "announced": announced is not None}


def download_file(url, dest, bar=None, stop=None, *, check, offline=None):
    """Download url to dest through dest + '.part', resuming with HTTP Range requests and retrying
    with exponential backoff. dest appears only once the size the server announced, its sha256 (if it
    announced one: announced_sha256) and check(path) pass; check raises ValueError('not a valid ...') for an
    incomplete or foreign file. A file whose sha256 differs is deleted and downloaded again, as is one that
    fails check. A host that cannot be reached at all fails at once, saying what to do offline (default: copy
    dest). Returns dest's manifest entry ({"bytes", "sha256"}, and "announced": whether the server's sha256
    was compared)."""
    part = dest + ".part"
    bar = bar or ByteBar(disable=True)
    counted, announced = [False], [None]  # whether this file's size is in the bar's total yet; its sha256
    size = lambda: os.path.getsize(part) if os.path.exists(part) else 0
    bar.update(size())  # bytes left by an interrupted run count as done
    try:  # an interrupted run may have stopped just before the rename: the next request says the sha256
        check(part)
        try:
            with requests.head(url, allow_redirects=True, timeout=TIMEOUT) as r:
                announced[0] = announced_sha256(r) if r.ok else None
        except requests.RequestException:  # offline: the size and check(part) alone, as for a copied file
            pass
        return _finish(part, dest, announced[0])
    except (ValueError, FileNotFoundError):
        pass
    except _Retry:  # damaged: downloaded again
        bar.update(-size())
        os.remove(part)
    failures = 0
    while True:
        if stop is not None and stop.is_set():
            raise DownloadError(f"{url}: stopped")
        have = size()
        try:
            total = _attempt(url, part, have, bar, counted, stop, announced)
            if total is not None and size() < total:
                raise _Retry(f"the body ended after {size()} of {total} bytes")
            try:
                check(part)
            except ValueError as e:
                raise _Retry(f"downloaded file is {e}", restart=True) from None
            return _finish(part, dest, announced[0])
        except (_Retry, requests.RequestException) as e:  # timeouts, dropped connections, 5xx
            error = _retryable(e, url, offline or f"copy {dest} from a machine with internet")
        restart = getattr(error, "restart", False)
        failures = 1 if size() > have and not restart else failures + 1
        if restart and os.path.exists(part):
            bar.update(-size())
            os.remove(part)
        _wait(url, failures, error)
