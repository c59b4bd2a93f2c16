"""fedderm's optional deployment accelerator (docs/deploy-internals.md): Flower's own SuperLink,
SuperNode and SuperExec, with a warm, approval-checking ClientApp launcher and shorter waits.
The app never imports it; stock ``flower-superlink`` / ``flower-supernode`` run the app as well.

* :mod:`~fedderm.accel.gate`: per role, patch (a verified Flower whose internals and behavioural
  self-tests pass) or run stock Flower with one warning; the ``fedderm-<role>`` scripts.
* :mod:`~fedderm.accel.forkserver`: each ClientApp task forked by the standard library's
  single-threaded fork server, which imported torch and Flower once.
* :mod:`~fedderm.accel.allow`: the hospital's allow-list of app bundle hashes, checked in the task.
* :mod:`~fedderm.accel.waits` and :mod:`~fedderm.accel.supernode`: Flower's sleeps capped at
  ``FEDDERM_POLL_INTERVAL``; the SuperNode wakes its SuperExec when a task exists.
* :mod:`~fedderm.accel.superlink` and :mod:`~fedderm.accel.node_registry`: link state in memory,
  registrations in ``--database``, idle pulls held until a message is stored.

``python -m fedderm.accel {supernode|superexec|superlink|app-hash} ...`` runs a role.
"""
