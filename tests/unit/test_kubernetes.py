"""The Kubeflow PyTorchJob: rendered for an image and a size, parsed back with a YAML parser, and checked
field by field against what the training operator needs (kind, elasticPolicy, rendezvous, command)."""

from __future__ import annotations

import shlex

import pytest
import yaml

from elastic_trainer.cli import main
from elastic_trainer.cli_parser import build_parser
from elastic_trainer.config import ConfigError
from elastic_trainer.launch.kubernetes import TEMPLATE, PyTorchJobSpec, render


def spec(**kw) -> PyTorchJobSpec:
    base = dict(
        image="registry.example.com/team/elastic-trainer:2026.11",
        min_replicas=2,
        max_replicas=4,
        gpus_per_replica=8,
        checkpoint_claim="ckpt-rwx",
        train_args=("--model", "gpt3-xl"),
    )
    return PyTorchJobSpec(**{**base, **kw})


def worker(doc: dict) -> dict:
    return doc["spec"]["pytorchReplicaSpecs"]["Worker"]


def container(doc: dict) -> dict:
    (only,) = worker(doc)["template"]["spec"]["containers"]
    return only


@pytest.mark.parametrize("lo, hi, gpus", [(1, 1, 1), (2, 4, 8), (1, 16, 4)])
def test_the_manifest_is_an_elastic_pytorchjob_of_the_asked_size(lo, hi, gpus):
    doc = yaml.safe_load(render(spec(min_replicas=lo, max_replicas=hi, gpus_per_replica=gpus)))
    assert (doc["apiVersion"], doc["kind"], doc["metadata"]["name"]) == (
        "kubeflow.org/v1",
        "PyTorchJob",
        "elastic-trainer",
    )
    assert doc["spec"]["elasticPolicy"] == {
        "rdzvBackend": "c10d",
        "rdzvId": "elastic-trainer",
        "rdzvPort": 29400,
        "minReplicas": lo,
        "maxReplicas": hi,
        "maxRestarts": 100,
    }
    # the operator's field is a string, and it refuses elasticPolicy.nProcPerNode beside it
    assert doc["spec"]["nprocPerNode"] == str(gpus) and "nProcPerNode" not in doc["spec"]["elasticPolicy"]
    assert set(doc["spec"]["pytorchReplicaSpecs"]) == {"Worker"}  # elastic: workers only, no Master
    assert worker(doc)["replicas"] == hi and worker(doc)["restartPolicy"] == "OnFailure"
    c = container(doc)
    assert c["name"] == "pytorch"  # the operator injects its PET_* variables into the container of this name
    assert c["image"] == "registry.example.com/team/elastic-trainer:2026.11"
    assert c["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert {"name": "pytorchjob-port", "containerPort": 29400} in c["ports"]


def test_the_command_is_our_torchrun_with_the_checkpoints_on_the_claim():
    doc = yaml.safe_load(render(spec(name="gpt3xl-run2", mount_path="/mnt/ck")))
    c = container(doc)
    assert c["command"] == [
        "python",
        "-m",
        "elastic_trainer.cli",
        "torchrun",
        "train",
        "--checkpoint-dir",
        "/mnt/ck/gpt3xl-run2",
        "--resume",
        "auto",
        "--model",
        "gpt3-xl",
    ]
    # no torchrun flags in the command: the operator's PET_* variables are torchrun's settings
    assert "--nnodes" not in c["command"] and "--rdzv-endpoint" not in c["command"]
    (mount,) = [m for m in c["volumeMounts"] if m["name"] == "checkpoints"]
    assert mount["mountPath"] == "/mnt/ck"
    volumes = {v["name"]: v for v in worker(doc)["template"]["spec"]["volumes"]}
    assert volumes["checkpoints"]["persistentVolumeClaim"] == {"claimName": "ckpt-rwx"}
    assert volumes["dshm"]["emptyDir"] == {"medium": "Memory"}
    assert worker(doc)["template"]["spec"]["terminationGracePeriodSeconds"] == 300
    assert doc["spec"]["elasticPolicy"]["rdzvId"] == "gpt3xl-run2"


@pytest.mark.parametrize(
    "image, args",
    [
        ('evil"\nkind: Pod', ("--model", "gpt-tiny")),
        ("img:1", ("--data", "a b.txt", "x: {y}", "'quoted'", "#not-a-comment", "ü")),
    ],
)
def test_values_never_add_yaml_structure(image, args):
    """An image or a train argument holding quotes, colons, braces, '#' or a newline stays one scalar."""
    if "\n" in image:
        with pytest.raises(ConfigError, match="--image must be a container image reference"):
            render(spec(image=image))
        return
    doc = yaml.safe_load(render(spec(image=image, train_args=args)))
    assert container(doc)["image"] == image
    assert container(doc)["command"][-len(args) :] == list(args)
    assert doc["kind"] == "PyTorchJob"


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(min_replicas=5, max_replicas=4), "--min-replicas 5 is above --max-replicas 4"),
        (dict(min_replicas=0), "--min-replicas must be a positive integer, got 0"),
        (dict(gpus_per_replica=0), "--gpus-per-replica must be a positive integer"),
        (dict(replicas=9), "--replicas 9 is outside 2..4"),
        (dict(replicas=1), "--replicas 1 is outside 2..4"),
        (dict(name="Elastic_Trainer"), "--name 'Elastic_Trainer' is not a valid PyTorchJob name"),
        (dict(name="9lives"), "is not a valid PyTorchJob name"),
        (dict(name="a" * 64), "is not a valid PyTorchJob name"),
        (dict(checkpoint_claim="Claim!"), "--checkpoint-claim 'Claim!' is not a valid claim name"),
        (dict(mount_path="checkpoints"), "--mount-path must be absolute"),
        (dict(rdzv_port=70000), "--rdzv-port must be a port number"),
        (dict(image=""), "--image must be"),
        (dict(train_args=("--checkpoint-dir", "/x")), "--checkpoint-dir is set by the PyTorchJob"),
        (dict(train_args=("--resume=never",)), "--resume is set by the PyTorchJob"),
        (dict(train_args=("--layout", "2,2,1")), "--layout is set by the PyTorchJob"),
    ],
)
def test_bad_settings_are_refused_in_one_line(change, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")) as err:
        render(spec(**change))
    assert "\n" not in str(err.value)


def test_replicas_at_the_start_may_be_below_the_maximum():
    doc = yaml.safe_load(render(spec(replicas=3)))
    assert worker(doc)["replicas"] == 3 and doc["spec"]["elasticPolicy"]["maxReplicas"] == 4


def test_every_placeholder_of_the_template_is_filled():
    text = render(spec())
    assert "${" not in text and "$" not in text.replace("$$", "")
    assert TEMPLATE.read_text().count("${") >= 10


def test_the_cli_prints_the_manifest_and_writes_it_to_a_file(capsys, tmp_path):
    argv = shlex.split(
        "kubernetes --image img:1 --min-replicas 1 --max-replicas 3 --gpus-per-replica 2 "
        "--checkpoint-claim ck -- --model gpt-tiny --global-batch 16"
    )
    assert main(argv) == 0
    doc = yaml.safe_load(capsys.readouterr().out)
    assert doc["spec"]["elasticPolicy"]["maxReplicas"] == 3
    assert container(doc)["command"][-4:] == ["--model", "gpt-tiny", "--global-batch", "16"]
    out = tmp_path / "job.yaml"
    assert main([*argv[:-5], "--output", str(out), *argv[-5:]]) == 0
    assert yaml.safe_load(out.read_text()) == doc
    assert "wrote" in capsys.readouterr().out


def test_the_cli_defaults_and_a_bad_setting_exiting_with_code_2(capsys):
    args = build_parser().parse_args(
        shlex.split("kubernetes --image i --min-replicas 1 --max-replicas 1 --gpus-per-replica 1 --checkpoint-claim c")
    )
    assert args.rdzv_port == 29400 and args.grace_s == 300 and args.name == "elastic-trainer"
    assert (
        main(
            shlex.split(
                "kubernetes --image i --min-replicas 2 --max-replicas 1 --gpus-per-replica 1 --checkpoint-claim c"
            )
        )
        == 2
    )
    assert "--min-replicas 2 is above --max-replicas 1" in capsys.readouterr().err


def test_a_train_argument_without_the_separator_is_refused_and_nothing_is_written(capsys, tmp_path):
    out = tmp_path / "job.yaml"
    argv = shlex.split(
        f"kubernetes --image i --min-replicas 1 --max-replicas 1 --gpus-per-replica 1 "
        f"--checkpoint-claim c --output {out} gpt-tiny"
    )
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err == (
        "elastic-trainer: error: unexpected 'gpt-tiny': put `train` arguments after -- (see kubernetes --help)\n"
    )
    assert not out.exists()
