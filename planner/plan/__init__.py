"""The plan: candidate layouts, their search and ranking, and the launch files of a choice."""
