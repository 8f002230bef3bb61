"""Peer formats: other trainers' checkpoints read and turned into ours (`interop.deepspeed`).

Nothing here is imported by training; the checkpoint package is used only through its train-state seam
(`checkpoint.train_state`), never through a Trainer.
"""
