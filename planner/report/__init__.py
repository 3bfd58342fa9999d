"""The report: what a plan says in words, tables and pictures (explain, compare, plot,
throughput), above the planner, which never imports it. Importing the package installs
`Plan.explain()`'s renderer (planner.plan.set_explainer)."""

import planner.report.explain  # noqa: F401
