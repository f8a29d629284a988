"""Engine adapters, one sub-package each; they register under the `difftest.engines` entry points."""
