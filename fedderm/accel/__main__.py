from fedderm.accel.gate import main

main()
