"""The receiver as a service under control: ``Receiver`` (``service.py``), its control calls
and the controller that carries them out (``controller.py``, ``controlled.py``), the HTTP
control API and its client, the daemon the CLI runs (``daemon.py``, with its snapshot folder
loader), and ``attach`` (a receiver beside a model a process already holds).

May import the rooms below it (``session``, ``strategy``, ``apply``), the floor and ``protocol``.
"""
