"""Reading video files frame-exactly, one concept a module:

    info           VideoInfo (what a header read learns), VideoReadError, StalledFile
    capture        OpenCV's capture, opened one way everywhere; the decoders' own logs quieted
    probe          the header read, checked against the file's packets
    prober         the probe in a child process with a deadline
    index_cache    the probes cached across runs
    frame_reader   FrameReader: what both decoders share (the read of chosen frames, the pixels stored as displayed,
                   a file shorter than its header)
    opencv_reader  OpenCVReader: seek-checked OpenCV reads
    pyav_reader    PyAVReader: the same reads with PyAV, an OpenCVReader of the file as its fallback
    choice         data.decoder (auto by codec and access) and open_reader
    reader_cache   the open readers of a process (fork-aware)

Kept free of imports: ``import datasets.video.probe`` loads no torch (the loader benchmark measures bare reads).
"""
