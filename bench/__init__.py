"""The benchmark harness: what the CPU benchmarks (``benchmarks/bench_<family>_cpu.py``) and ``selective-rope bench``
share.

- :mod:`.machine`: the machine (device, load, provenance) and the ``Quiet`` that waits for other processes;
- :mod:`.timing`: interleaved timed rounds and their records;
- :mod:`.measure`: the measurements every family shares (prefill, cached decoding, position-embedding overhead);
- :mod:`.report`: tables, header and footer, the JSON file;
- :mod:`.runner`: one family's full run, driven by its :class:`~.runner.FamilyBenchmark` spec;
- :mod:`.quick`: the quick measurement of ``selective-rope bench`` (prefill, decode, training per family);
- :mod:`.cli`: the ``bench`` command.
"""
