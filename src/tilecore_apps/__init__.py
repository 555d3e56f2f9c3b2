"""Applications built on tilecore, shipped with it: they use only tilecore's public API.

- `tilecore_apps.dlrm`: the DLRM-style click model and its trainer (model, loop,
  input workers, metrics, plots, checkpoints) that `tilecore train` runs.
- `tilecore_apps.bench`: the benchmarks behind `tilecore bench`.
- `tilecore_apps.cli`: the `tilecore` command, a thin driver over the two and the library.

The library (`tilecore`) never imports this package.
"""
