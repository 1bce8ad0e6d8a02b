"""Checkpoints on disk: the format, finding, saving, restoring and verifying them.

Owns `_format` (layout, tree conversions, the meta record), `_paths` (finding checkpoints, what a
`ckpt_path` names), `_writer` (saving through orbax, retention), `_guard` (one writing run per
directory, disk faults), `_restore` (a fit's state and position, or a model for inference) and
`_verify` (checksums of every saved array). May import `state`, `hparams`, `data` (a
DataModule's state), `strategies` (canonical layouts), `distributed` and the root modules; the
callbacks (`ModelCheckpoint`), the module (`load_from_checkpoint`) and the fit sit above it.
"""
