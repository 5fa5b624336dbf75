"""The plan simulator behind ``muonkit plan``: a model's real jobs and plan on any mesh, no cluster needed.

:mod:`~muonkit.simulator.models` lists a model's Muon matrices (bundled shapes or a Hugging Face
config), :mod:`~muonkit.simulator.meshes` lays them out as the torch APIs do on a described mesh,
:mod:`~muonkit.simulator.simulate` builds the jobs and plans with the library's own functions and
reads off each rank's work, and :mod:`~muonkit.simulator.host` runs the executor's per-step
bookkeeping for one rank with the collectives stubbed. :mod:`~muonkit.simulator.report` prints it.
"""
