"""fedderm's optional deployment accelerator: Flower's own SuperLink, SuperNode and SuperExec with
a warm, approval-checking ClientApp launcher and shorter waits (deployment only; the app never
imports it, and stock ``flower-superlink`` / ``flower-supernode`` run the app as well).

Flower starts one fresh ``flwr-clientapp`` process per message (Python, torch and the app
imported every time) and waits on fixed sleeps (SuperNode pull 3 s, reply wait 0.5 s, object-pull
back-off 1, 2, 4, 8 s).  The accelerator keeps Flower's own task loop and per-task token and
changes, through the narrowest hook the installed Flower offers:

* :mod:`~fedderm.accel.forkserver`: ``fedderm-superexec``'s executor hands each ClientApp task to
  a single-threaded fork server, started before Flower starts any thread, which has imported
  torch, Flower and the approved app once (:mod:`~fedderm.accel.warm`) and forks one child per
  task; the child calls Flower's ``run_clientapp`` with the task's token, as ``flwr-clientapp
  --token`` does.  One message = one token = one child, as in Flower.
* :mod:`~fedderm.accel.allow`: before any app code runs, the child checks the app bundle (FAB)
  against the hospital's allow-list of sha256 hashes (``--allow-list FILE`` or
  ``FEDDERM_ALLOW_LIST``); a bundle not on it is refused with one log line and an error reply.
* :mod:`~fedderm.accel.waits` and :mod:`~fedderm.accel.supernode`: ``fedderm-supernode`` clamps
  its idle sleeps to ``FEDDERM_POLL_INTERVAL`` (default 0.05 s) and wakes its SuperExec through a
  pipe when a task exists.
* :mod:`~fedderm.accel.superlink`: ``fedderm-superlink`` keeps link state and objects in memory,
  the registered SuperNodes in ``--database`` (:mod:`~fedderm.accel.node_registry`), and holds an
  idle SuperNode's pull until a message is stored.

:mod:`~fedderm.accel.gate` decides, per role, whether to patch (a verified Flower version whose
internals and behavioural self-tests pass) or run stock Flower with one warning.
``python -m fedderm.accel {supernode|superexec|superlink|app-hash} ...`` runs a role.
"""
