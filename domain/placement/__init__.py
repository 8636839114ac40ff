"""Placement: the compatibility rules and the ranking (``rules``, ``ranking``), the
evidence a decision records (``evidence``), and the decision that turns a schedule
request, its sandbox and its home runner into new events or a typed refusal
(``deciding``)."""
