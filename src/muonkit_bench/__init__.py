"""muonkit's benchmark suite: the benchmark GPT, the offline corpus, one module per ``muonkit bench`` command.

A separate package beside the library (installed by ``pip install 'muonkit[bench]'``; from a clone,
``make setup``): the library never imports it. ``muonkit bench <name>`` reaches it through
:mod:`muonkit_bench.cli`.
"""
