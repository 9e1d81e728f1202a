! gtc.f90 — the GTC stand-in of gtc.c in Fortran: STEPS steps of one array
! phi(N) of doubles, phi(i) = step * 1000003 + (i - 1), streamed with
! dmover-stream.
!
!   gtc PRODUCER SINKS SPILL_DIR STEPS N COMPUTE_MS
!
! Build, from the repository's top directory (docs/STREAMING.md):
!   cargo build --release -p dmover-stream
!   gfortran -O2 crates/stream/include/dmover_stream.f90 crates/stream/examples/gtc.f90 \
!     target/release/libdmover_stream.a -lpthread -ldl -lm -o gtc-f
program gtc
  use iso_c_binding
  use dmover_stream
  implicit none
  character(len=256) :: producer, sinks, spill, arg
  integer(c_int64_t) :: steps, n, step, i
  integer :: compute_ms, rc
  real(c_double), allocatable, target :: phi(:)
  type(c_ptr) :: h
  type(dms_report) :: r
  character(len=32) :: num

  call get_command_argument(1, producer)
  call get_command_argument(2, sinks)
  call get_command_argument(3, spill)
  call get_command_argument(4, arg); read(arg, *) steps
  call get_command_argument(5, arg); read(arg, *) n
  call get_command_argument(6, arg); read(arg, *) compute_ms
  allocate(phi(n))

  call check(dms_open(dms_str(producer), dms_str(sinks), dms_str(spill), 0_c_int64_t, 0_c_int64_t, 0_c_int32_t, h), "dms_open")
  do step = 0, steps - 1
    do i = 1, n
      phi(i) = real(step * 1000003_c_int64_t + (i - 1), c_double)
    end do
    call sleep_ms(compute_ms)
    write(num, '(I0)') n
    call check(dms_write_metadata(h, dms_str("var"), dms_str("phi")), "dms_write_metadata")
    call check(dms_write_metadata(h, dms_str("dims"), dms_str(num)), "dms_write_metadata")
    write(num, '(I0)') step
    call check(dms_write_metadata(h, dms_str("step"), dms_str(num)), "dms_write_metadata")
    call check(dms_write(h, c_loc(phi), int(n * 8, c_size_t)), "dms_write")
    call check(dms_end_step(h), "dms_end_step")
  end do
  rc = dms_close(h, r)
  write(*, '(A,I0,A,I0,A,I0,A,I0,A,I0,A)') "steps=", r%steps, " bytes=", r%bytes, " spilled_blocks=", r%spilled_blocks, &
    " failovers=", r%failovers, " undelivered=", r%undelivered_blocks, " "
  call check(rc, "dms_close")

contains

  subroutine check(code, what)
    integer(c_int), intent(in) :: code
    character(len=*), intent(in) :: what
    if (code /= 0) then
      write(0, *) "gtc: ", what, " failed: ", dms_error_message()
      error stop 1
    end if
  end subroutine

  subroutine sleep_ms(ms)
    integer, intent(in) :: ms
    interface
      integer(c_int) function usleep(us) bind(C, name="usleep")
        import :: c_int, c_int32_t
        integer(c_int32_t), value :: us
      end function
    end interface
    integer(c_int) :: ignored
    ignored = usleep(int(ms * 1000, c_int32_t))
  end subroutine
end program
