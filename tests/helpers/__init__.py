"""What the tests share besides the fixtures in ``tests/conftest.py``; the tests themselves mirror lazyckpt's
packages (``tests/write/`` for ``lazyckpt/write/``, ...), and tests of root modules sit in ``tests/``.

| module | owns |
|---|---|
| ``distributed`` | several gloo ranks in forked processes (``run_ranks``), two rendezvous in one process |
| ``forge`` | hand-made and edited checkpoint files (headers, manifests, seals) for the strict reader's tests |
| ``remote`` | a moto S3 server the tests start themselves, buckets on it, a flaky remote |
| ``host_faults`` | the host level's copy of a step to ``dirpath`` held back, so a crash lands between the two |
| ``lightning_run`` | a small Lightning fine-tuning run, in process and as a script (crash, resume, DDP, FSDP2) |
| ``trainer_run`` | a tiny Hugging Face Trainer or TRL SFTTrainer run (full or LoRA) as a script: crash, resume |
| ``rollback_run`` | a Lightning run that goes non-finite, in process and as a DDP script |
| ``soak`` | save, load and verify in a loop, sampling what a long run must not accumulate |
| ``reliability`` | the reliability suite's engines (fuzzing, byte flips, SIGKILLs, soak), also runnable for long |
| ``mutations`` | seeded mutations of a multi-rank checkpoint's manifests, written resealed into fresh directories |
| ``fuzz_readers`` | every reader run on those mutations of a real 2-rank FSDP2 checkpoint, outcomes classified |
"""
