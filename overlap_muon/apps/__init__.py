"""The applications beside the library: the training job (``train``, ``model``, ``data``), the benchmarks
(``bench``), the timeline drawer (``timeline``), the scale simulator (``simulate``) and the rank spawner the tests
and benchmarks share (``spawn``). The library (every other module of ``overlap_muon``) never imports this package;
``tests/test_structure.py`` checks it. Their extra dependencies (tqdm, matplotlib) come with
``pip install 'overlap-muon[apps]'``."""
