"""Where the UI's events come from, on worker threads: the :class:`~.base.EventSource`
interface, a trace file (:mod:`.file`, with its count pass :mod:`.countpass`), a running job
(:mod:`.live`), a list of events (:mod:`.scripted`), what the command line names (:mod:`.open`),
and the :class:`~.inbox.Inbox` they hand everything to. No textual imports, and no torch.
"""
