"""The remote level through the integrations: resume on a fresh node whose local directory is empty."""

from __future__ import annotations

import shutil

from _remote_helpers import moto_endpoint, s3_remote  # noqa: F401 - fixtures
from conftest import assert_tree_equal
from test_accelerate_hook import (STEPS_PER_EPOCH, build, final_state, fresh_accelerate_state,  # noqa: F401
                                  reset_accelerate, train)

import lazyckpt
from lazyckpt import LazyCheckpointHook


def test_accelerate_resumes_from_the_remote_when_the_local_directory_is_empty(tmp_path, s3_remote):
    url, options = s3_remote
    reference = build()
    train(reference, range(2))
    expected = final_state(reference)
    reset_accelerate()

    first = build()
    hook = LazyCheckpointHook(tmp_path / "node-a", every_n_steps=STEPS_PER_EPOCH, remote=url,
                              storage_options=options).register(first[0])
    train(first, range(1))
    hook.close()
    shutil.rmtree(tmp_path / "node-a")
    reset_accelerate()

    second = build()
    hook = LazyCheckpointHook(tmp_path / "node-b", every_n_steps=STEPS_PER_EPOCH, remote=url,
                              storage_options=options).register(second[0])
    assert hook.resume() == STEPS_PER_EPOCH
    train(second, range(1, 2))
    hook.close()
    assert_tree_equal(final_state(second), expected)


def test_accelerate_with_a_url_dirpath_resumes_from_it(tmp_path, s3_remote):
    url, options = s3_remote
    first = build()
    hook = LazyCheckpointHook(url, every_n_steps=STEPS_PER_EPOCH, spool_dir=str(tmp_path / "spool-a"),
                              storage_options=options).register(first[0])
    train(first, range(1))
    hook.close()
    expected = final_state(first)
    reset_accelerate()
    second = build()
    hook = LazyCheckpointHook(url, every_n_steps=STEPS_PER_EPOCH, spool_dir=str(tmp_path / "spool-b"),
                              storage_options=options).register(second[0])
    assert hook.resume() == STEPS_PER_EPOCH
    hook.close()
    assert_tree_equal(final_state(second)["model"], expected["model"])

