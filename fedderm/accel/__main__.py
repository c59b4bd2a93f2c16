from fedderm.accel.gate import main

if __name__ == "__main__":  # not when multiprocessing prepares a forked task
    main()
