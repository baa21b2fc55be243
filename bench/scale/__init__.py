"""Scale rehearsals: costs that grow with samples, shards, ranks or workers, measured at
rising sizes, fitted to a power law and carried to CC12M or ImageNet (``__main__``), and
one data set through the four commands at rising size (``rehearsal``)."""
