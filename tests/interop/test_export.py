"""Exports for tools that know nothing of lazyckpt: a model.safetensors with plain names, a Lightning .ckpt."""

from __future__ import annotations

import argparse
import os
import json

import numpy as np
import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from torch import nn

import lazyckpt
from helpers.forge import RANK0, edit_manifest
from helpers.remote import moto_endpoint, s3_remote  # noqa: F401 - fixtures
from lazyckpt.interop.export import FORMATS, export


class TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)  # weight all ones, bias all zeros: constant, never merged
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embed.weight


def save(tmp_path, state):
    with lazyckpt.LazyCheckpointer(tmp_path / "ckpt") as ckpt:
        return ckpt.save(state, step=1).wait()


def lightning_like(module):
    """What LazyCheckpoint stores for a LightningModule holding ``self.model = module``."""
    return {"pytorch-lightning_version": "2.6.0", "global_step": 1,
            "state_dict": {f"model.{k}": v for k, v in module.state_dict().items()},
            "hyper_parameters": {"ns": argparse.Namespace(lr=0.1), "arr": np.arange(2)}}


def test_safetensors_export_has_plain_names_and_tied_weights_once(tmp_path):
    model = TiedLM()
    path = save(tmp_path, lightning_like(model))
    out = export(path, tmp_path / "hf" / "model.safetensors", format="safetensors")
    with safe_open(out, framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        names = list(f.keys())
    assert sorted(names) == ["embed.weight", "norm.bias", "norm.weight"], "prefix gone, head.weight stored once"
    loaded = load_file(out)
    missing, unexpected = TiedLM().load_state_dict(loaded, strict=False)
    assert missing == ["head.weight"] and unexpected == []
    assert torch.equal(loaded["embed.weight"], model.embed.weight)


def test_safetensors_export_keeps_duplicates_and_prefixes_when_asked(tmp_path):
    model = TiedLM()
    path = save(tmp_path, {"model": model.state_dict(), "step": 1})
    out = export(path, tmp_path / "model.safetensors", format="safetensors", dedupe=False, strip_prefix="")
    assert sorted(load_file(out)) == sorted(model.state_dict())


def test_safetensors_export_refuses_a_state_without_weights(tmp_path):
    path = save(tmp_path, {"step": 1, "notes": "no tensors"})
    with pytest.raises(lazyckpt.CheckpointFormatError, match="not a flat dict of tensors"):
        export(path, tmp_path / "model.safetensors", format="safetensors")
    with pytest.raises(ValueError, match="format='onnx'"):
        export(path, tmp_path / "model.onnx", format="onnx")


def test_lightning_export_loads_with_weights_only(tmp_path):
    model = TiedLM()
    path = save(tmp_path, lightning_like(model))
    out = export(path, tmp_path / "model.ckpt")
    plain = torch.load(out, weights_only=True)
    assert plain["hyper_parameters"] == {"ns": {"lr": 0.1}, "arr": [0, 1]}
    assert torch.equal(plain["state_dict"]["model.head.weight"], model.head.weight)


def test_transformers_from_pretrained_accepts_the_export(tmp_path):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=50, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).eval()
    path = save(tmp_path, lightning_like(model))
    out_dir = tmp_path / "hf"
    export(path, out_dir / "model.safetensors", format="safetensors")
    (out_dir / "config.json").write_text(json.dumps(config.to_dict()))
    loaded = transformers.GPT2LMHeadModel.from_pretrained(out_dir).eval()
    ids = torch.tensor([[1, 2, 3]])
    assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_the_cli_exports_and_reports_a_missing_checkpoint(tmp_path, capsys):
    from lazyckpt.cli import main

    path = save(tmp_path, lightning_like(TiedLM()))
    assert main(["export", path, str(tmp_path / "m.safetensors"), "--format", "safetensors"]) == 0
    assert sorted(load_file(tmp_path / "m.safetensors")) == ["embed.weight", "norm.bias", "norm.weight"]
    assert main(["export", str(tmp_path / "nope"), str(tmp_path / "x.ckpt")]) == 1
    assert "nope" in capsys.readouterr().err


def test_an_export_never_writes_through_a_file_planted_where_its_temp_file_could_go(tmp_path):
    with lazyckpt.LazyCheckpointer(tmp_path / "ckpt") as ckpt:
        path = ckpt.save({"model": {"w": torch.ones(3)}}, step=1).wait()
    victim = tmp_path / "victim"
    victim.write_bytes(b"keep me")
    out = tmp_path / "out" / "model.safetensors"
    out.parent.mkdir()
    os.symlink(victim, f"{out}.tmp")  # the fixed temp name an export used to write through
    export(path, out, format="safetensors")
    assert victim.read_bytes() == b"keep me"
    assert torch.equal(load_file(str(out))["w"], torch.ones(3))
    assert sorted(os.listdir(out.parent)) == ["model.safetensors", "model.safetensors.tmp"], "no temp file left"


def test_a_remote_checkpoint_exports_to_a_local_file_with_its_storage_options(tmp_path, s3_remote, capsys):
    from lazyckpt.cli import main

    url, options = s3_remote
    model = TiedLM()
    with lazyckpt.LazyCheckpointer(url, storage_options=options, spool_dir=str(tmp_path / "spool")) as ckpt:
        remote = ckpt.save(lightning_like(model), step=1).wait_remote()
    out = export(remote, tmp_path / "api" / "model.ckpt", storage_options=options)
    assert torch.equal(torch.load(out, weights_only=True)["state_dict"]["model.head.weight"], model.head.weight)
    out = export(remote, tmp_path / "api" / "model.safetensors", format="safetensors", storage_options=options)
    assert sorted(load_file(out)) == ["embed.weight", "norm.bias", "norm.weight"]
    flags = ["--storage-options", json.dumps(options)]
    for name, fmt in [("m.ckpt", "lightning"), ("m.safetensors", "safetensors")]:
        assert main(["export", remote, str(tmp_path / "cli" / name), "--format", fmt, *flags]) == 0, \
            capsys.readouterr().err
    assert torch.load(tmp_path / "cli" / "m.ckpt", weights_only=True)["global_step"] == 1
    assert torch.equal(load_file(tmp_path / "cli" / "m.safetensors")["embed.weight"], model.embed.weight)


def test_an_unreachable_or_misconfigured_remote_export_is_one_line_naming_url_and_options(tmp_path, capsys):
    """A wrong endpoint gave a raw botocore EndpointConnectionError traceback, an unknown storage option a raw
    TypeError: both are RemoteUnreachableError naming the URL and the options (secrets masked), exit 1 in the CLI."""
    from helpers.remote import free_port, s3_options
    from lazyckpt.cli import main

    url = "s3://bucket/run/step-0000001"
    nowhere = s3_options(f"http://127.0.0.1:{free_port()}")  # nothing listens there
    for options, said in [(nowhere, "EndpointConnectionError"), ({"no_such_option": 1}, "TypeError")]:
        with pytest.raises(lazyckpt.RemoteUnreachableError) as refused:
            export(url, tmp_path / "m.ckpt", storage_options=options)
        message = str(refused.value)
        assert f"path={url!r} is not reachable with storage_options=" in message and said in message
        if options is nowhere:
            assert "'endpoint_url': 'http://127.0.0.1:" in message and "'secret': '***'" in message
            assert "testing" not in message, "no credentials in a message"
        else:
            assert "'no_such_option': 1" in message
        assert main(["export", url, str(tmp_path / "m.ckpt"), "--storage-options", json.dumps(options)]) == 1
        err = capsys.readouterr().err
        assert said in err and url in err and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert not os.path.exists(tmp_path / "m.ckpt")


def test_exporting_a_run_directory_names_the_newest_step_to_export(tmp_path, capsys):
    """The advice was ckpt_path='last' (Lightning's), which means nothing to an export."""
    from lazyckpt.cli import main

    with lazyckpt.LazyCheckpointer(tmp_path / "ckpt") as ckpt:
        for step in (1, 2):
            newest = ckpt.save({"model": {"w": torch.ones(3)}}, step=step).wait()
    for fmt in FORMATS:
        with pytest.raises(lazyckpt.CheckpointNotFoundError) as refused:
            export(tmp_path / "ckpt", tmp_path / "m.out", format=fmt)
        assert f"lazyckpt export {newest} {tmp_path / 'm.out'}" in str(refused.value)
        assert "ckpt_path" not in str(refused.value)
    assert main(["export", str(tmp_path / "ckpt"), str(tmp_path / "m.ckpt")]) == 1
    assert f"newest committed one is {newest}" in capsys.readouterr().err


def test_an_export_to_a_url_is_refused_naming_the_argument(tmp_path, capsys, monkeypatch):
    from lazyckpt.cli import main

    path = save(tmp_path, lightning_like(TiedLM()))
    monkeypatch.chdir(tmp_path)  # where a URL taken for a local path would land
    for fmt in FORMATS:
        with pytest.raises(ValueError, match=r"out_file='s3://bucket/m' is a URL.*local path"):
            export(path, "s3://bucket/m", format=fmt)
    assert main(["export", path, "s3://bucket/m.ckpt"]) == 2
    assert "is a URL" in capsys.readouterr().err
    assert not os.path.exists("s3:")


def _replace_device(node, new):
    """The tree with every ``$torch_device`` node's string replaced by ``new``."""
    if isinstance(node, dict):
        return {k: (new if k == "$torch_device" else _replace_device(v, new)) for k, v in node.items()}
    if isinstance(node, list):
        return [_replace_device(v, new) for v in node]
    return node


@pytest.mark.parametrize("crafted", ["cuda:128", "cuda:256", "cuda:255", "mps:300"])
def test_an_export_refuses_a_crafted_device_string_naming_file_and_key(tmp_path, crafted):
    """torch.device('cuda:128') wraps to index -128, which torch.load(weights_only=True) refuses; 'cuda:256' and
    'cuda:255' wrap to another device without a word."""
    state = lightning_like(TiedLM())
    state["hyper_parameters"]["device"] = torch.device("cuda", 0)
    path = save(tmp_path, state)
    edit_manifest(os.path.join(path, RANK0), lambda doc: doc.update(tree=_replace_device(doc["tree"], crafted)))
    for fmt, out in [("lightning", tmp_path / "m.ckpt"), ("safetensors", tmp_path / "m.safetensors")]:
        with pytest.raises(lazyckpt.CheckpointFormatError,
                           match=rf"rank-00000\.json: tree at state\['hyper_parameters'\]\['device'\]: .*{crafted}"):
            export(path, out, format=fmt)
        assert not out.exists()
    with pytest.raises(lazyckpt.CheckpointFormatError, match=crafted):
        lazyckpt.verify(path)


def test_the_export_check_names_the_key_torch_load_would_refuse():
    from lazyckpt.interop.weights_only import check_weights_only

    check_weights_only({"w": torch.ones(2), "d": torch.device("cuda", 3), "s": {1, 2}}, "ckpt")  # all readable
    with pytest.raises(lazyckpt.CheckpointFormatError,
                       match=r"ckpt: state\['a'\]\[1\]\['b'\] = .*frozenset.*weights_only=True.*nothing was written"):
        check_weights_only({"a": [torch.ones(2), {"b": frozenset({1})}]}, "ckpt")  # torch's safe unpickler refuses it


def test_the_export_check_keeps_torchs_reason_and_finds_one_bad_leaf_among_many():
    from lazyckpt.interop.weights_only import check_weights_only

    state = {"hparams": {f"k{i}": i for i in range(5000)}, "w": [torch.ones(2)] * 100}
    state["hparams"]["k4321"] = frozenset({1})
    with pytest.raises(lazyckpt.CheckpointFormatError) as info:
        check_weights_only(state, "ckpt")
    message = str(info.value)
    assert "state['hparams']['k4321']" in message
    assert "Unsupported global: GLOBAL frozenset" in message and "\x1b" not in message, "torch's reason, plain"
    assert "add_safe_globals" in message, "and the fix"
