"""muonkit's benchmark suite: the benchmark GPT, the offline corpus, one module per ``muonkit bench`` command.

A separate package beside the library (not on PyPI yet: ``pip install -e ./bench`` in a clone or the wheel of ``make dist``; from a clone,
``make setup``): the library never imports it. ``muonkit bench <name>`` reaches it through
:mod:`muonkit_bench.cli`.
"""
