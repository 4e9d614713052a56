"""The approval gate's library side: the summary a reviewer decides on, the records of decisions."""
