"""Speed and memory benchmarks: each module times or weighs one part of the service
against a baseline run in the same process, and states its targets as ratios."""
