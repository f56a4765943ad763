"""One component measured or checked alone: model speed, codecs, the terminal UI's cost, robust
reducers on real averagers, and the CUDA path (``gpu_check``)."""
