"""Integrations of actormesh with other frameworks, one module each.

- :mod:`actormesh.integrations.lightning`: ``ActorMeshStrategy``, which runs
  ``lightning.Trainer.fit`` (and validate/test/predict) as DDP on a proc mesh
  driven from the controller script.

Importing this package imports nothing else; each module imports its
framework when it is imported itself.
"""
