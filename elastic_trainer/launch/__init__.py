"""The launcher: hosts files, per-host torchrun/ssh commands, and the driver that runs them."""
