"""A damaged file is never read as good: each kind of file the project writes, with one byte flipped and cut short,
is refused in one line naming it before anything is trained or written, or skipped by --init_from=auto with its
line. Checkpoints are made once per module (or per session: test_fsdp's) and damaged in copies. At several ranks,
every rank makes the same choice, even when only one of them sees the damage, and a resume reads each byte of a
ckpt.dcp twice in all (verified once by the ranks together, then loaded), each rank a ckpt.pt once."""
import errno
import json
import os
import shutil
import struct
import zipfile

import pytest
import torch
import torch.distributed as dist

import prepare
import train
from conftest import in_process, made_once, spawn
from engine import checkpoint, data, files, sharding
from engine.checkpoint import load_checkpoint, load_model, load_resumable
from engine.configurator import read_args
from engine.files import DamagedError
from tests.test_data import library  # noqa: F401  (a fixture: a small Python library folder)
from tests.test_faults import run
#                                                                             ckpt.dcp, made once)
from tests.test_fsdp import FIXTURES, _join  # noqa: F401  (fixtures: the 2-rank
from tests.test_fsdp import args as fsdp_args
from tests.test_fsdp import stop_script, stopped, torchrun
from tests.test_train import SMALL, data_dir, free_port  # noqa: F401  (data_dir: a fixture)


def damage(path, how):
    """One byte of path flipped (in its middle; of a .pt file, in the middle of its largest entry: what a reader uses,
    not the padding of a header), or the file cut to half its length."""
    size = os.path.getsize(path)
    if how == "truncate":
        os.truncate(path, size // 2)
        return
    where = size // 2
    if str(path).endswith(".pt"):
        with zipfile.ZipFile(path) as z:
            entry = max(z.infolist(), key=lambda e: e.file_size)
        with open(path, "rb") as f:
            f.seek(entry.header_offset + 26)  # the local header's name and extra lengths (the zip format)
            n, m = struct.unpack("<HH", f.read(4))
        where = entry.header_offset + 30 + n + m + entry.file_size // 2
    with open(path, "r+b") as f:
        f.seek(where)
        byte = f.read(1)[0]
        f.seek(where)
        f.write(bytes([byte ^ 0x01]))


def one_line(message, start):
    assert "\n" not in message and message.startswith(start), message
    return message


def listing(folder):
    """Every file under folder, with its bytes: what a refused run must leave as it was."""
    return {os.path.join(d, f): open(os.path.join(d, f), "rb").read() for d, _, fs in os.walk(folder) for f in fs}


# ----------------------------------------------------------------------------- torch.save'd files (.pt)

@pytest.fixture(scope="module")
def run_dir(data_dir, tmp_path_factory):  # noqa: F811
    """A run of 4 steps, in one process, with every kind of .pt: ckpt.pt, ckpt_000002_full.pt (keep_full),
    ckpt_000002.pt and ckpt_000004.pt (keep_every). Only read: tests damage copies."""
    out = tmp_path_factory.mktemp("integrity") / "run"
    train.main(SMALL + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=4", "--keep_every=2",
                        "--keep_full=2"])
    return out


def args(data_dir, out, *extra):  # noqa: F811
    return SMALL + [f"--data_dir={data_dir}", f"--out_dir={out}", "--max_steps=4", *extra]


@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("name, init_from", [("ckpt.pt", "resume"), ("ckpt_000002_full.pt", "{path}")])
def test_a_damaged_resumable_checkpoint_is_refused_before_anything_is_written(
        run_dir, data_dir, name, init_from, how, tmp_path, capsys):  # noqa: F811
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    path = out / name
    damage(path, how)
    into = out if name == "ckpt.pt" else tmp_path / "branch"  # a branch starts a run of its own
    before = listing(tmp_path)
    result, _, _ = in_process(train.main, args(data_dir, into, f"--init_from={init_from.format(path=path)}",
                                               "--max_steps=6"), capsys)
    what = "/data/0: its bytes do not match the CRC-32" if how == "flip" else "File is not a zip file"
    assert what in one_line(str(result), f"train.py: error: {path}: damaged: ")
    assert listing(tmp_path) == before  # nothing trained, nothing written


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_weights_only_checkpoint_is_refused_by_every_reader(run_dir, how, tmp_path):
    path = tmp_path / "ckpt_000002.pt"
    shutil.copy(run_dir / "ckpt_000002.pt", path)
    load_model(str(path))  # as kept, it verifies
    damage(path, how)
    for read in (load_model, lambda p: load_checkpoint(p, mmap=True)):  # eval.py's, sample.py's; analyze.py's
        with pytest.raises(DamagedError) as e:
            read(str(path))
        one_line(str(e.value), f"{path}: damaged: ")


def test_auto_skips_a_damaged_checkpoint_and_ends_as_the_run_that_was_not_damaged(run_dir, data_dir, tmp_path,
                                                                                    capsys):  # noqa: F811
    """ckpt.pt damaged: --init_from=auto says so in one line and continues from the newest that verifies, the branch
    point of step 2, which ends bit for bit as the run did."""
    out = tmp_path / "run"
    shutil.copytree(run_dir, out)
    damage(out / "ckpt.pt", "flip")
    result, _, err = in_process(train.main, args(data_dir, out, "--init_from=auto"), capsys)
    assert not isinstance(result, SystemExit), result
    skipped = [line for line in err.splitlines() if "skipped" in line]
    assert len(skipped) == 1 and skipped[0].startswith(f"note: --init_from=auto: skipped {out}/ckpt.pt: damaged: ")
    done, kept = load_checkpoint(str(out / "ckpt.pt")), load_checkpoint(str(run_dir / "ckpt.pt"))
    assert done["step"] == 4 and all(torch.equal(done["model"][k], v) for k, v in kept["model"].items())
    damage(out / "ckpt.pt", "truncate")
    damage(out / "ckpt_000002_full.pt", "truncate")
    with pytest.raises(DamagedError) as e:
        load_resumable(str(out), "auto")
    assert one_line(str(e.value), f"{out}/ckpt.pt: damaged: ").endswith(f"; no other checkpoint in {out} verifies")


def test_a_checkpoint_of_torchs_format_before_zip_is_read_with_a_note(tmp_path, capsys):
    path = str(tmp_path / "old.pt")
    torch.save({"model": {"w": torch.ones(2)}, "model_config": {}}, path, _use_new_zipfile_serialization=False)
    assert torch.equal(load_checkpoint(path)["model"]["w"], torch.ones(2))
    assert capsys.readouterr().err == f"note: {path}: not a zip file (torch's format before 1.6): its bytes cannot " \
                                      f"be verified\n"


# ----------------------------------------------------------------------------- a 2-rank ckpt.dcp

@pytest.mark.parametrize("how", ["flip", "truncate"])
@pytest.mark.parametrize("name", [".metadata", "__1_0.distcp", "state.json", "manifest.json"])
def test_a_damaged_file_of_a_sharded_checkpoint_is_refused_in_one_line(stopped, name, how, tmp_path):  # noqa: F811
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    dcp = out / "ckpt.dcp"
    assert sorted(os.listdir(dcp)) == sorted([".metadata", "__0_0.distcp", "__1_0.distcp", "state.json",
                                              "manifest.json"])
    damage(dcp / name, how)
    for resume in (lambda: load_resumable(str(out), "resume", sharded=True), lambda: load_checkpoint(str(dcp))):
        with pytest.raises(DamagedError) as e:
            resume()
        one_line(str(e.value), f"{dcp}/{name}: " if name != "manifest.json" else f"{dcp}/")
    with pytest.raises(DamagedError) as e:  # auto: no other checkpoint to go on from
        load_resumable(str(out), "auto", sharded=True)
    assert str(e.value).endswith(f"; no other checkpoint in {out} verifies")


def test_of_a_ckpt_pt_and_a_ckpt_dcp_the_later_is_resumed_and_a_damaged_one_is_passed_over_for_the_other(
        stopped, run_dir, tmp_path):  # noqa: F811
    """A run stopped between a save and the removal of the other kind's older checkpoint (DDP and FSDP in turn) holds
    both: the later one is resumed from, and one damaged is passed over for the other, never read as good."""
    out = tmp_path / "run"
    shutil.copytree(stopped, out)  # ckpt.dcp of step 5
    shutil.copy(run_dir / "ckpt.pt", out)  # of step 4
    whole, directory = str(out / "ckpt.pt"), str(out / "ckpt.dcp")
    assert checkpoint.own_checkpoint(str(out), sharded=False)[0] == directory
    state = (out / "ckpt.dcp" / "state.json").read_bytes()
    damage(out / "ckpt.dcp" / "state.json", "flip")
    assert checkpoint.own_checkpoint(str(out), sharded=True)[0] == whole
    assert load_resumable(str(out), "auto", sharded=True)[0]["step"] == 4
    (out / "ckpt.dcp" / "state.json").write_bytes(state)
    damage(out / "ckpt.pt", "truncate")  # no step readable
    assert checkpoint.own_checkpoint(str(out), sharded=False)[0] == directory
    assert load_resumable(str(out), "auto")[0]["step"] == 5


def test_a_sharded_checkpoint_lists_every_file_it_wrote_and_one_written_before_manifests_reads_with_a_note(
        stopped, capsys, tmp_path):  # noqa: F811
    sharding.verify(f"{stopped}/ckpt.dcp")  # as written, it verifies
    listed = sharding.json.load(open(f"{stopped}/ckpt.dcp/manifest.json"))["files"]
    assert sorted(listed) == [".metadata", "__0_0.distcp", "__1_0.distcp", "state.json"]
    assert [n for n in listed if "sha256" in listed[n]] == [".metadata", "state.json"]  # a .distcp: its CRC-32s
    assert all(listed[n]["bytes"] == os.path.getsize(f"{stopped}/ckpt.dcp/{n}") for n in listed)
    out = tmp_path / "run"
    shutil.copytree(stopped, out)
    (out / "ckpt.dcp" / "__2_0.distcp").write_bytes(b"")  # not one it wrote
    with pytest.raises(DamagedError, match=r"__2_0.distcp: not in manifest.json"):
        sharding.verify(str(out / "ckpt.dcp"))
    os.remove(out / "ckpt.dcp" / "manifest.json")  # not read as one written before manifests
    with pytest.raises(DamagedError, match=r"ckpt.dcp/manifest.json: missing, though state.json says it was written"):
        sharding.verify(str(out / "ckpt.dcp"))
    capsys.readouterr()
    old = f"{FIXTURES}/fsdp_2_ranks/ckpt.dcp"
    assert sharding.read_state(old)["step"] == 3
    assert capsys.readouterr().err == f"note: {old}: no manifest.json (written before checksums): its bytes " \
                                      f"cannot be verified\n"


# ----------------------------------------------------------------------------- a launch of 4 ranks

class Flipping:
    """A file whose reads of more than 1 kB (a tensor's bytes, not a header's) come with a byte flipped."""

    def __init__(self, f):
        self.f = f

    def seek(self, *args):
        return self.f.seek(*args)

    def readinto(self, buffer):
        n = self.f.readinto(buffer)
        if n > 1024:
            memoryview(buffer).cast("B")[n // 2] ^= 0x01
        return n


def hurt(how):
    """How one rank alone is hurt as it reads: "flip", a byte of each tensor of a ckpt.pt that it reads (through
    files.VerifyingReader) flipped, as if the file changed between its read and the others'; "eio", a read error
    (EIO) on each tensor of a ckpt.dcp that it verifies (sharding._Slice)."""
    if how == "flip":
        init = files.VerifyingReader.__init__

        def flipping(self, f, what):
            init(self, f, what)
            if what.endswith("/ckpt.pt"):
                self.f = Flipping(f)

        files.VerifyingReader.__init__ = flipping
    else:
        def failing(self, buffer):
            raise OSError(errno.EIO, os.strerror(errno.EIO))

        sharding._Slice.readinto = failing


def rchar():
    """The bytes this process has read so far (/proc/self/io: every read() of a file, from the page cache too)."""
    with open("/proc/self/io") as f:
        return int(next(line for line in f if line.startswith("rchar:")).split()[1])


def _four_ranks_worker(rank, port, cases, runs, data_dir, corpus, result):  # noqa: F811
    """One of 4 ranks (gloo). Each case (out_dir, init_from, sharded, how rank 1 alone is hurt): load_resumable, this
    rank's outcome, [path, step] or ["error", its line]. Per run (name, out_dir, keys): the bytes it reads in
    train.start (configure, build, restore) of a resume, less in that of the same run started fresh (the second of
    each: the first imports what a start needs); and in check_data of the corpus with hashes (--verify_data=True).
    Into result.<rank> (JSON); its stderr into result.<rank>.err."""
    worker, outcomes, reads = _join(rank, 4, port), [], {}
    with open(f"{result}.{rank}.err", "w") as err:
        os.dup2(err.fileno(), 2)
    for out, init_from, sharded, how in cases:
        saved = files.VerifyingReader.__init__, sharding._Slice.readinto
        if rank == 1:
            hurt(how)
        try:
            ckpt, path = load_resumable(out, init_from, sharded=sharded, worker=worker)
            outcomes.append([path, ckpt["step"]])
        except (ValueError, OSError) as e:
            outcomes.append(["error", str(e)])
        files.VerifyingReader.__init__, sharding._Slice.readinto = saved
    for name, out, keys in runs:
        given = read_args(SMALL + [f"--data_dir={data_dir}", f"--out_dir={out}", "--batch_size=1", *keys],
                          train.ALL_DEFAULTS)
        read = {}
        for init_from in ("scratch", "auto") * 2:
            start = {**given, "init_from": init_from}
            before = rchar()
            train.start(start, train.TrainConfig(**{k: v for k, v in start.items() if k in train.DEFAULTS}), worker)
            read[init_from] = rchar() - before
        reads[name] = read["auto"] - read["scratch"]
    before = rchar()
    data.check_data(corpus, True, worker=worker)
    reads["data"] = rchar() - before
    with open(f"{result}.{rank}", "w") as f:
        json.dump({"outcomes": outcomes, "reads": reads}, f)
    dist.destroy_process_group()


@pytest.fixture(scope="session")
def four_ranks(stopped, data_dir, tmp_path_factory):  # noqa: F811
    """train.py under torchrun at 4 ranks, FSDP, --init_from=auto, in a copy of the 2-rank run stopped at step 5 whose
    ckpt.dcp has a byte flipped in a .distcp file, beside the branch point keep_full kept (here a copy of that
    checkpoint under keep_full's name), to step 6: its outcome (exit status, stdout, stderr: outcome.json) and its
    run directory, which then holds the checkpoint of step 6 that 4 ranks wrote (made once, only read)."""
    def make(folder):
        out = folder / "run"
        shutil.copytree(stopped, out)
        shutil.copytree(out / "ckpt.dcp", out / "ckpt_000005_full.dcp")
        damage(out / "ckpt.dcp" / "__1_0.distcp", "flip")
        outcome = run(torchrun(4) + ["train.py", *fsdp_args(data_dir, str(out), "--fsdp=True", "--batch_size=1",
                                                            "--max_steps=6")])
        with open(folder / "outcome.json", "w") as f:
            json.dump(outcome, f)

    return made_once(tmp_path_factory, "fsdp_four_ranks", make)


@pytest.fixture(scope="module")
def four_gloo_ranks(run_dir, stopped, four_ranks, data_dir, corpus, tmp_path_factory):  # noqa: F811
    """_four_ranks_worker's cases and runs at 4 ranks, spawned once for the tests that read them (made once: every
    worker reads the same), in copies of the checkpoints and the corpus: (each rank's {"outcomes", "reads", "err":
    its stderr}, the folder of the copies)."""
    def make(folder):
        pt, dcp, alone = folder / "pt", folder / "dcp", folder / "alone"
        shutil.copytree(run_dir, pt)
        for out in (dcp, alone):
            shutil.copytree(stopped, out)  # ckpt.dcp of step 5
        shutil.copy(run_dir / "ckpt.pt", dcp)  # of step 4
        shutil.copytree(corpus, folder / "corpus")
        cases = [(str(pt), "auto", False, "flip"), (str(pt), "resume", False, "flip"),
                 (str(dcp), "auto", True, "eio"), (str(alone), "resume", True, "eio")]
        runs = [("ckpt.pt", str(pt), ["--max_steps=6"]), ("ckpt.dcp", f"{four_ranks}/run", ["--fsdp=True",
                                                                                          "--max_steps=8"])]
        spawn(_four_ranks_worker, (free_port(), cases, runs, data_dir, str(folder / "corpus"),
                                   str(folder / "result")), 4)

    folder = made_once(tmp_path_factory, "four_gloo_ranks", make)
    ranks = [{**json.load(open(f"{folder}/result.{rank}")), "err": open(f"{folder}/result.{rank}.err").read()}
             for rank in range(4)]
    return ranks, folder


def test_a_damaged_byte_or_a_read_error_that_one_rank_alone_sees_leads_every_rank_to_the_same_choice(
        four_gloo_ranks):
    """4 ranks, rank 1 alone hurt as it reads: a byte of ckpt.pt changed for it skips ckpt.pt on every rank for the
    branch point of step 2 (auto; rank 0 says so, once), and refuses it on every rank, in the same line (resume); a
    read error in its share of a ckpt.dcp's check passes it over, on every rank, for the ckpt.pt beside it (auto), and
    refuses it on every rank (resume)."""
    ranks, folder = four_gloo_ranks
    outcomes = [r["outcomes"] for r in ranks]
    assert all(o == outcomes[0] for o in outcomes), outcomes
    (skip, step), (refused, why), (other, later), (refused_dcp, why_dcp) = outcomes[0]
    assert [skip, step, other, later] == [f"{folder}/pt/ckpt_000002_full.pt", 2, f"{folder}/dcp/ckpt.pt", 4]
    assert refused == refused_dcp == "error"
    one_line(why, f"{folder}/pt/ckpt.pt: damaged: entry ")
    assert "its bytes do not match the CRC-32" in why
    assert one_line(why_dcp, f"{folder}/alone/ckpt.dcp/__").endswith(
        f"damaged: [Errno {errno.EIO}] {os.strerror(errno.EIO)}")
    assert [r["err"].count("note: --init_from=auto: skipped") for r in ranks] == [1, 0, 0, 0], ranks


def test_a_flipped_byte_in_one_distcp_file_at_4_ranks_resumes_the_kept_full_checkpoint_and_says_so_once(four_ranks):
    """--init_from=auto at 4 ranks, a byte of a .distcp file of ckpt.dcp flipped: one note, on rank 0's stderr, that
    it skips ckpt.dcp, and the run goes on from the branch point of keep_full, resharded from 2 ranks to 4, to the
    end (exit status 0)."""
    code, stdout, stderr = json.load(open(f"{four_ranks}/outcome.json"))
    out = f"{four_ranks}/run"
    assert code == 0, stderr[-3000:]
    skipped = [line for line in stderr.splitlines() if "skipped" in line]
    assert len(skipped) == 1 and skipped[0].startswith(f"note: --init_from=auto: skipped {out}/ckpt.dcp/__1_0.distcp: "
                                                       ) and ": damaged: entry " in skipped[0], stderr[-3000:]
    assert f"resuming from {out}/ckpt_000005_full.dcp at step 5" in stdout
    assert sharding.read_state(f"{out}/ckpt.dcp")["step"] == 6


def test_a_resume_at_4_ranks_reads_a_ckpt_pt_once_a_rank_and_a_ckpt_dcp_twice_in_all(four_gloo_ranks, four_ranks):
    """Counted as a user would (/proc/self/io), a resume less a fresh start, summed over 4 ranks: a ckpt.pt under DDP
    read once by each rank (verified in the read that loads it), 4 S; a ckpt.dcp of 4 ranks under FSDP verified once
    by the ranks together, then loaded, 2 S, and the small files that every rank reads (.metadata, state.json, the
    manifest); --verify_data=True's shards hashed once in all, D, and its manifest on each rank. Besides: the zip
    directories, of ckpt.pt and of each tensor of a .distcp file (1.8 kB each: at this size, 0.4 S)."""
    ranks, folder = four_gloo_ranks
    read = {name: sum(r["reads"][name] for r in ranks) for name in ranks[0]["reads"]}
    dcp = f"{four_ranks}/run/ckpt.dcp"
    pt, whole = os.path.getsize(f"{folder}/pt/ckpt.pt"), {f: os.path.getsize(f"{dcp}/{f}") for f in os.listdir(dcp)}
    small = sum(whole[f] for f in (".metadata", "state.json", "manifest.json"))
    corpus_bytes = sum(e["bytes"] for e in data.read_manifest(f"{folder}/corpus").values())
    tensors = len(sharding.read_state(dcp)["sharded_metadata"].storage_data)
    assert 4 * pt <= read["ckpt.pt"] <= 4 * pt + 4 * 32768, (read, pt)
    assert 2 * sum(whole.values()) <= read["ckpt.dcp"] <= 2 * sum(whole.values()) + 3 * small + 2 * 1024 * tensors, \
        (read, whole, tensors)
    assert corpus_bytes <= read["data"] <= corpus_bytes + 4 * 1024, read  # and each rank's manifest, /proc/self/io


# ----------------------------------------------------------------------------- shards

@pytest.fixture(scope="module")
def corpus(library, tmp_path_factory):  # noqa: F811
    """The built-in corpus of test_data's small library, built once (only read)."""
    out = tmp_path_factory.mktemp("corpus") / "stdlib"
    data.build_corpus(out, str(library[0]), workers=1)
    return out


@pytest.mark.parametrize("how", ["flip", "truncate"])
def test_a_damaged_corpus_shard_is_refused_by_verify_and_by_train(corpus, how, tmp_path, capsys):
    d = tmp_path / "stdlib"
    shutil.copytree(corpus, d)
    assert prepare.verify(str(d)) == 2  # as built, it verifies
    shard = d / "stdlib_train_000001.bin"
    damage(shard, how)
    result, _, _ = in_process(prepare.main, ["--verify", "--data_dir", str(d)], capsys)
    why = "its sha256 differs from" if how == "flip" else "manifest.json says"
    assert why in one_line(str(result), f"prepare.py: error: {shard}: ")
    # the sizes at every start, the hashes when asked; refused before the run writes anything
    out = tmp_path / "out"
    result, _, _ = in_process(train.main, SMALL + [f"--data_dir={d}", f"--out_dir={out}", "--max_steps=1",
                                                   "--verify_data=True", "--vocab_size=50304"], capsys)  # GPT-2's
    assert why in one_line(str(result), f"train.py: error: {shard}: ")
    assert not out.exists()


# ----------------------------------------------------------------------------- what a write costs

def test_bench_times_checkpoint_writes_without_checksums_as_before_and_now(tmp_path, capsys):
    from tools import bench
    tiny = ["--n_layer=1", "--n_embd=32", "--n_head=2", "--vocab_size=64", "--block_size=16"]
    result = bench.main(["configs/dyn_exo.py", *tiny, f"--checkpoint={tmp_path}", "--rounds=1", "--steps=1"])
    assert sorted(result) == [("dyn_exo", "ckpt.dcp"), ("dyn_exo", "ckpt.pt")]
    assert all(set(times) == {"none", "before", "now"} and min(times.values()) > 0 for times in result.values())
    assert "now/none" in capsys.readouterr().out and os.listdir(tmp_path) == []  # each write removed
    small = dict(n_layer=1, n_embd=32, n_head=2, vocab_size=64, block_size=16)
    row = bench.Row("x", *train.split_config({**train.ALL_DEFAULTS, **small}), bench.BENCH_DEFAULTS)
    tensors = bench.resume_tensors(row)
    for how in bench.WRITES:  # what each way writes: "now" verifies; without checksums, nothing does
        bench.write_checkpoint(tensors, str(tmp_path / f"{how}.pt"), how)
        bench.write_checkpoint(tensors, str(tmp_path / f"{how}.dcp"), how)
    load_checkpoint(str(tmp_path / "now.pt"), ("optimizers",))
    sharding.verify(str(tmp_path / "now.dcp"))
    with pytest.raises(DamagedError, match="its bytes do not match the CRC-32 00000000"):
        load_checkpoint(str(tmp_path / "none.pt"), ())
