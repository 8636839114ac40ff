"""Access to the HTTP service: access tokens (:mod:`.tokens`), the view of them every
request checks (:mod:`.cache`), and the caller they make (:mod:`.principal`)."""
