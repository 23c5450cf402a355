"""The benchmark harness of the repository (not part of the installed package): what the benchmark scripts beside
it share. The scripts import it as ``harness`` (``python benchmarks/<script>.py`` puts ``benchmarks/`` on the path).

- :mod:`.machine`: the machine (device, load, provenance) and the ``Quiet`` that waits for other processes;
- :mod:`.timing`: interleaved timed rounds and their records;
- :mod:`.measure`: the measurements every family shares (prefill, cached decoding, position-embedding overhead);
- :mod:`.report`: tables, header and footer, the JSON file;
- :mod:`.runner`: one family's full run, driven by its :class:`~.runner.FamilyBenchmark` spec.

The quick ``selective-rope bench`` of the installed package is :mod:`selective_rope.bench`.
"""
