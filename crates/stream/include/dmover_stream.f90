! dmover_stream.f90 — Fortran bindings of dmover_stream.h (iso_c_binding).
!
! Strings passed in must end with c_null_char (use dms_str). Handles are
! type(c_ptr). Every function returns 0 or an error class (DMS_E* in the C
! header); dms_error_message() gives the message of the last failure.
module dmover_stream
  use iso_c_binding
  implicit none
  private
  public :: dms_open, dms_set_timeouts, dms_set_replicas, dms_write, &
            dms_write_metadata, dms_end_step, dms_close, dms_report, dms_str, dms_error_message

  type, bind(C) :: dms_report
    integer(c_int64_t) :: steps, bytes, blocks, spilled_blocks, spilled_bytes, resent_blocks, failovers, undelivered_blocks
    integer(c_int32_t) :: max_streams
    real(c_double) :: seconds
  end type

  interface
    integer(c_int) function dms_open(producer, destinations, spill_dir, buffer_bytes, block_bytes, max_wait_ms, h) &
        bind(C, name="dms_open")
      import :: c_int, c_char, c_int64_t, c_int32_t, c_ptr
      character(kind=c_char), dimension(*), intent(in) :: producer, destinations, spill_dir
      integer(c_int64_t), value :: buffer_bytes, block_bytes
      integer(c_int32_t), value :: max_wait_ms
      type(c_ptr), intent(out) :: h
    end function

    integer(c_int) function dms_write(h, data, len) bind(C, name="dms_write")
      import :: c_int, c_ptr, c_size_t
      type(c_ptr), value :: h, data
      integer(c_size_t), value :: len
    end function

    integer(c_int) function dms_write_metadata(h, key, val) bind(C, name="dms_write_metadata")
      import :: c_int, c_ptr, c_char
      type(c_ptr), value :: h
      character(kind=c_char), dimension(*), intent(in) :: key, val
    end function

    integer(c_int) function dms_set_timeouts(h, close_seconds, ack_seconds) bind(C, name="dms_set_timeouts")
      import :: c_int, c_ptr, c_double
      type(c_ptr), value :: h
      real(c_double), value :: close_seconds, ack_seconds
    end function

    integer(c_int) function dms_set_replicas(h, replicas) bind(C, name="dms_set_replicas")
      import :: c_int, c_ptr, c_int32_t
      type(c_ptr), value :: h
      integer(c_int32_t), value :: replicas
    end function

    integer(c_int) function dms_end_step(h) bind(C, name="dms_end_step")
      import :: c_int, c_ptr
      type(c_ptr), value :: h
    end function

    integer(c_int) function dms_close(h, report) bind(C, name="dms_close")
      import :: c_int, c_ptr, dms_report
      type(c_ptr), value :: h
      type(dms_report), intent(out) :: report
    end function

    type(c_ptr) function dms_last_error() bind(C, name="dms_last_error")
      import :: c_ptr
    end function

    integer(c_size_t) function c_strlen(s) bind(C, name="strlen")
      import :: c_size_t, c_ptr
      type(c_ptr), value :: s
    end function
  end interface

contains

  ! A Fortran string as a C string.
  function dms_str(s) result(c)
    character(len=*), intent(in) :: s
    character(kind=c_char, len=len_trim(s) + 1) :: c
    c = trim(s) // c_null_char
  end function

  ! The message of the last failure on this thread.
  function dms_error_message() result(msg)
    character(len=:), allocatable :: msg
    type(c_ptr) :: p
    character(kind=c_char), pointer :: chars(:)
    integer :: i, n
    p = dms_last_error()
    n = int(c_strlen(p))
    call c_f_pointer(p, chars, [n])
    allocate(character(len=n) :: msg)
    do i = 1, n
      msg(i:i) = chars(i)
    end do
  end function
end module
